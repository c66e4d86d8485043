//! One episode, turn by turn: the model takes a turn on everything so far,
//! the environment answers, the answer is appended (masked from the loss),
//! until the environment says done, the turn limit, or the token budget.
//!
//! The episode's rollout holds every token with its loss mask (model 1,
//! observation 0), the behaviour log-prob and version of every model token
//! (observation tokens: 0 and the version of the turn before), and a turn
//! id per token. Each turn starts from the newest weights and, in partial
//! mode, takes newer ones mid-turn, so versions stay per token.

use std::{
    collections::BTreeMap,
    sync::atomic::{AtomicU8, Ordering},
    time::{Duration, Instant},
};

use bapo_policy::{Finish, Response, tokenizer::TextTokenizer};
use metrics::{counter, histogram};
use tokio::runtime::Handle;

use super::{
    EnvError, EnvInfo, Environment, ResetInput, Retry, StepOutcome, Turn, render::Renderer,
    with_retries,
};
use crate::metrics as names;

/// Distinct `info` keys per episode, at most: each becomes an `env.<key>`
/// entry of the rollout's metadata, which the buffer bounds (64 entries).
pub const MAX_INFO_KEYS: usize = 32;

/// The bounds of one episode.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_turns: u32,
    /// Response tokens, turns and observations together.
    pub max_tokens: usize,
    /// One turn's cap (`[actor.sampling] max_new_tokens`).
    pub turn_tokens: usize,
    pub call_timeout: Duration,
    pub deadline: Duration,
}

/// What the model made of one turn.
pub enum TurnMade {
    /// The turn, and the learner incarnation of the weights that made it.
    Turn(Response, u64),
    /// The actor is stopping.
    Stop,
    /// Nothing usable (the engine is down); the episode is dropped.
    Skip(&'static str),
}

/// The slot's engine, taking turns.
pub trait Model {
    /// A turn of at most `max_new` tokens after `context`.
    fn turn(&mut self, context: &[u32], max_new: usize, turn: u32) -> TurnMade;
}

/// A finished episode.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Episode {
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<u32>,
    /// 1: the model's token; 0: the environment's.
    pub mask: Vec<u8>,
    pub turn_ids: Vec<u32>,
    /// The sum of the steps' rewards.
    pub reward: f32,
    /// `Stop`: the environment ended it; `Length`: a limit did.
    pub finish: Option<Finish>,
    pub turns: u32,
    pub tool_calls: u32,
    pub observation_tokens: usize,
    pub incarnation: u64,
    /// The last turn's text (the final answer when the environment ended
    /// the episode).
    pub final_text: String,
    /// The last value of each `info` key.
    pub info: BTreeMap<String, String>,
}

impl Episode {
    /// Appends an environment's observation after `turn`: context for the
    /// next turn, no loss (mask 0, log-prob 0), labelled with the version
    /// of the turn it answers.
    fn observe(&mut self, tokens: Vec<u32>, turn: u32) {
        let version = self.versions.last().copied().unwrap_or(0);
        let n = tokens.len();
        self.observation_tokens += n;
        self.tokens.extend(tokens);
        self.logprobs.extend(std::iter::repeat_n(0.0, n));
        self.versions.extend(std::iter::repeat_n(version, n));
        self.mask.extend(std::iter::repeat_n(0, n));
        self.turn_ids.extend(std::iter::repeat_n(turn, n));
    }
}

/// How an episode ended.
#[derive(Debug)]
pub enum EpisodeEnd {
    Done(Box<Episode>),
    /// Given up, with the reason counted.
    Dropped(&'static str),
    /// The actor is stopping.
    Stopped,
}

/// Runs episodes of one environment for one slot.
pub struct Runner<'a> {
    pub env: &'a dyn Environment,
    pub info: &'a EnvInfo,
    pub renderer: &'a Renderer,
    pub tokenizer: &'a TextTokenizer,
    pub stop_tokens: &'a [u32],
    pub limits: Limits,
    pub retry: Retry,
    pub handle: &'a Handle,
}

/// How a group's episodes are played.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Members {
    /// One after another, the group given up at the first that does not
    /// finish.
    InTurn,
    /// All at once, each on a thread of its own: an engine that batches
    /// concurrent requests (vLLM) makes their turns together.
    AtOnce,
}

/// What a group's members at once tell each other: once one of them has
/// not finished, the group cannot be pushed, so the others stop at their
/// next turn instead of playing (and holding sessions) for nothing.
#[derive(Default)]
struct GroupEnd(AtomicU8);

impl GroupEnd {
    const PLAYING: u8 = 0;
    const DROPPED: u8 = 1;
    const STOPPED: u8 = 2;

    fn record(&self, end: &EpisodeEnd) {
        let what = match end {
            EpisodeEnd::Done(_) => return,
            EpisodeEnd::Dropped(_) => Self::DROPPED,
            EpisodeEnd::Stopped => Self::STOPPED,
        };
        let _ = self
            .0
            .compare_exchange(Self::PLAYING, what, Ordering::AcqRel, Ordering::Acquire);
    }

    /// How a member still playing ends, if the group has ended.
    fn cut_short(&self) -> Option<EpisodeEnd> {
        match self.0.load(Ordering::Acquire) {
            Self::DROPPED => Some(dropped("group_dropped", "another member was dropped")),
            Self::STOPPED => Some(EpisodeEnd::Stopped),
            _ => None,
        }
    }
}

impl Runner<'_> {
    /// A group's episodes, one per `(input, model)`, in member order. In
    /// turn, the list ends at the first episode that did not finish (the
    /// group is dropped with it); at once, the others end at their next
    /// turn (`group_dropped`, or stopped if the actor is stopping).
    pub fn run_group<M: Model + Send>(
        &self,
        members: Vec<(ResetInput<'_>, M)>,
        how: Members,
    ) -> Vec<EpisodeEnd> {
        match how {
            Members::InTurn => {
                let mut ends = Vec::with_capacity(members.len());
                for (input, mut model) in members {
                    let end = self.run(input, &mut model);
                    let done = matches!(end, EpisodeEnd::Done(_));
                    ends.push(end);
                    if !done {
                        break;
                    }
                }
                ends
            }
            Members::AtOnce => self.at_once(members),
        }
    }

    /// Each member on a thread of its own, told when the group has ended.
    fn at_once<M: Model + Send>(&self, members: Vec<(ResetInput<'_>, M)>) -> Vec<EpisodeEnd> {
        let group = &GroupEnd::default();
        std::thread::scope(|scope| {
            let threads: Vec<_> = members
                .into_iter()
                .map(|(input, mut model)| {
                    scope.spawn(move || {
                        let end = self.run_in(input, &mut model, group);
                        group.record(&end);
                        end
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect()
        })
    }

    /// One episode from `input`, its environment state closed at the end
    /// whatever happened.
    pub fn run(&self, input: ResetInput<'_>, model: &mut dyn Model) -> EpisodeEnd {
        self.run_in(input, model, &GroupEnd::default())
    }

    fn run_in(&self, input: ResetInput<'_>, model: &mut dyn Model, group: &GroupEnd) -> EpisodeEnd {
        let t0 = Instant::now();
        let started = self.call("reset", || self.env.reset(input));
        let started = match started {
            Ok(s) => s,
            Err(e) => return dropped(e.reason, &e.to_string()),
        };
        let id = started.episode_id.clone();
        let end = match self.renderer.prompt(&started.observation) {
            Ok(prompt) => self.turns(&id, prompt, model, t0, group),
            Err(e) => dropped("bad_observation", &e.to_string()),
        };
        let timeout = self.limits.call_timeout;
        self.handle.block_on(async {
            let _ = tokio::time::timeout(timeout, self.env.close(&id)).await;
        });
        if let EpisodeEnd::Done(ep) = &end {
            histogram!(names::EPISODE_TURNS).record(ep.turns as f64);
            let share = ep.observation_tokens as f64 / ep.tokens.len().max(1) as f64;
            histogram!(names::OBSERVATION_TOKEN_SHARE).record(share);
        }
        end
    }

    fn turns(
        &self,
        id: &str,
        prompt: Vec<u32>,
        model: &mut dyn Model,
        t0: Instant,
        group: &GroupEnd,
    ) -> EpisodeEnd {
        let max_turns = match self.info.max_turns {
            0 => self.limits.max_turns,
            n => n.min(self.limits.max_turns),
        };
        let mut ep = Episode {
            prompt,
            finish: Some(Finish::Length),
            ..Default::default()
        };
        let mut lineage = None;
        for turn in 0..max_turns {
            let left = self.limits.max_tokens.saturating_sub(ep.tokens.len());
            if left == 0 {
                break;
            }
            if t0.elapsed() > self.limits.deadline {
                return dropped("episode_timeout", "past actor.env.episode_timeout_s");
            }
            if let Some(end) = group.cut_short() {
                return end;
            }
            let context: Vec<u32> = ep.prompt.iter().chain(&ep.tokens).copied().collect();
            let (response, incarnation) =
                match model.turn(&context, self.limits.turn_tokens.min(left), turn) {
                    TurnMade::Turn(r, i) => (r, i),
                    TurnMade::Stop => return EpisodeEnd::Stopped,
                    TurnMade::Skip(reason) => return dropped(reason, "the engine made no turn"),
                };
            if *lineage.get_or_insert(incarnation) != incarnation {
                return dropped("new_lineage", "weights of another learner incarnation");
            }
            ep.incarnation = incarnation;
            let out = match self.step(id, &response, turn, &mut ep) {
                Ok(out) => out,
                Err(e) => return dropped(e.reason, &e.to_string()),
            };
            if out.done || out.truncated {
                ep.finish = Some(if out.done {
                    Finish::Stop
                } else {
                    Finish::Length
                });
                break;
            }
            let Some(obs) = out.observation else {
                return dropped("no_observation", "a step that is not done sent nothing");
            };
            let stop = response
                .tokens
                .last()
                .copied()
                .filter(|t| self.stop_tokens.contains(t));
            let rendered = match self.renderer.after_turn(&obs, stop) {
                Ok(r) => r,
                Err(e) => return dropped("bad_observation", &e.to_string()),
            };
            if rendered.truncated {
                counter!(names::OBSERVATIONS_TRUNCATED).increment(1);
            }
            if ep.tokens.len() + rendered.tokens.len() >= self.limits.max_tokens {
                break;
            }
            ep.observe(rendered.tokens, turn);
        }
        EpisodeEnd::Done(Box::new(ep))
    }

    /// Appends the model's turn to `ep` and sends it; the answer's reward
    /// is checked against the declared range and added.
    fn step(
        &self,
        id: &str,
        response: &Response,
        turn: u32,
        ep: &mut Episode,
    ) -> Result<StepOutcome, EnvError> {
        let visible = match response.tokens.last() {
            Some(t) if self.stop_tokens.contains(t) => {
                &response.tokens[..response.tokens.len() - 1]
            }
            _ => &response.tokens[..],
        };
        let text = self.tokenizer.decode(visible).unwrap_or_default();
        let n = response.tokens.len();
        ep.tokens.extend(&response.tokens);
        ep.logprobs.extend(&response.logprobs);
        ep.versions.extend(&response.versions);
        ep.mask.extend(std::iter::repeat_n(1, n));
        ep.turn_ids.extend(std::iter::repeat_n(turn, n));
        ep.turns += 1;
        let sent = Turn {
            text: &text,
            tokens: &response.tokens,
            truncated: response.finish == Some(Finish::Length),
            index: turn,
        };
        let out = if self.env.steps_retryable() {
            self.call("step", || self.env.step(id, sent))?
        } else {
            let once = Runner {
                retry: Retry {
                    retries: 0,
                    ..self.retry
                },
                ..*self
            };
            once.call("step", || self.env.step(id, sent))?
        };
        let (lo, hi) = (self.info.min_reward, self.info.max_reward);
        let in_range = |r: f32| r.is_finite() && r >= lo && r <= hi;
        if !in_range(out.reward) || !in_range(ep.reward + out.reward) {
            return Err(EnvError::new(
                "bad_reward",
                format!(
                    "step reward {} (episode {}) outside the declared [{lo}, {hi}]",
                    out.reward,
                    ep.reward + out.reward
                ),
                false,
            ));
        }
        ep.reward += out.reward;
        if out.info.get("tool_call").is_some_and(|v| v == "1") {
            ep.tool_calls += 1;
            counter!(names::TOOL_CALLS).increment(1);
        }
        ep.info.extend(out.info.clone());
        if ep.info.len() > MAX_INFO_KEYS {
            return Err(EnvError::new(
                "garbage",
                format!("more than {MAX_INFO_KEYS} distinct info keys in one episode"),
                false,
            ));
        }
        ep.final_text = text;
        Ok(out)
    }

    /// One environment call on the slot's thread, each attempt bounded by
    /// the call timeout, retried as configured, its latency recorded.
    fn call<'a, T, F>(&'a self, what: &'static str, f: impl Fn() -> F) -> Result<T, EnvError>
    where
        F: std::future::Future<Output = Result<T, EnvError>> + 'a,
    {
        let timeout = self.limits.call_timeout;
        let t0 = Instant::now();
        let r = self.handle.block_on(with_retries(self.retry, what, || {
            let fut = f();
            async move {
                match tokio::time::timeout(timeout, fut).await {
                    Ok(r) => r,
                    Err(_) => Err(EnvError::new(
                        "timeout",
                        format!("no answer within {} ms", timeout.as_millis()),
                        true,
                    )),
                }
            }
        }));
        histogram!(names::ENV_SECONDS, "call" => what).record(t0.elapsed().as_secs_f64());
        r
    }
}

fn dropped(reason: &'static str, detail: &str) -> EpisodeEnd {
    counter!(names::EPISODES_DROPPED, "reason" => reason).increment(1);
    tracing::warn!("episode dropped ({reason}): {detail}");
    EpisodeEnd::Dropped(reason)
}

/// What packing a group of episodes needs besides the episodes.
pub struct EpisodePacking<'a> {
    pub packing: &'a crate::rollout::Packing<'a>,
    pub task: &'a dyn bapo_tasks::Task,
    pub problem: &'a bapo_tasks::Problem,
}

/// The group's wire rollouts: one per episode, shaping laid on the
/// episode's reward (its format check on the final turn, its length
/// counted in the model's tokens only).
pub fn pack(
    p: &EpisodePacking<'_>,
    episodes: Vec<Episode>,
    origin: &crate::rollout::Origin<'_>,
) -> Vec<bapo_proto::v1::Rollout> {
    use bapo_proto::{packed, v1};
    let sampling = v1::SamplingParams {
        temperature: p.packing.sampling.temperature,
        top_k: u32::try_from(p.packing.sampling.top_k).unwrap_or(u32::MAX),
        top_p: p.packing.sampling.top_p,
    };
    episodes
        .into_iter()
        .enumerate()
        .map(|(i, ep)| {
            let model_tokens = ep.tokens.len() - ep.observation_tokens;
            let well_formed = p.task.well_formed(p.problem, &ep.final_text);
            let reward = p
                .packing
                .shaping
                .apply(ep.reward, well_formed, model_tokens);
            let finish = match ep.finish {
                Some(Finish::Stop) => v1::FinishReason::Stop,
                _ => v1::FinishReason::Length,
            };
            let mut metadata: std::collections::HashMap<String, String> = [
                ("problem_id", p.problem.id.clone()),
                ("reward_source", p.packing.source.to_string()),
                ("turns", ep.turns.to_string()),
                ("tool_calls", ep.tool_calls.to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            for (k, v) in &ep.info {
                metadata.insert(format!("env.{k}"), v.clone());
            }
            v1::Rollout {
                rollout_id: format!("{}/{i}", origin.group_id),
                group_id: origin.group_id.to_string(),
                prompt_tokens: packed::pack_u32(&ep.prompt),
                response_tokens: packed::pack_u32(&ep.tokens),
                behavior_logprobs: packed::pack_f32(&ep.logprobs),
                token_versions: packed::pack_u32(&ep.versions),
                reward,
                token_rewards: Default::default(),
                finish_reason: finish as i32,
                actor_id: origin.actor_id.to_string(),
                task: p.packing.task.to_string(),
                metadata,
                learner_incarnation: origin.incarnation,
                sampling: Some(sampling),
                loss_mask: ep.mask.into(),
                turn_ids: packed::pack_u32(&ep.turn_ids),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use bapo_policy::tokenizer::TextTokenizer;
    use bapo_tasks::{ArithTool, Problem, Task};

    use super::*;
    use crate::env::{builtin::Calculator, config::TruncateSide};

    /// Plays the given turns, each made by weights one version newer.
    struct Script {
        tok: TextTokenizer,
        turns: Vec<&'static str>,
        contexts: Vec<Vec<u32>>,
        /// Where every member's first turn waits for the others.
        meet: Option<Arc<Meeting>>,
    }

    /// A barrier that gives up: `arrive` says whether all `n` members
    /// were in their first turn at once (within a generous wait).
    struct Meeting {
        n: usize,
        arrived: std::sync::Mutex<usize>,
        all: std::sync::Condvar,
    }

    impl Meeting {
        fn arrive(&self) -> bool {
            let mut arrived = self.arrived.lock().unwrap();
            *arrived += 1;
            self.all.notify_all();
            let wait = Duration::from_secs(30);
            let (arrived, _) = self
                .all
                .wait_timeout_while(arrived, wait, |a| *a < self.n)
                .unwrap();
            *arrived >= self.n
        }
    }

    impl Model for Script {
        fn turn(&mut self, context: &[u32], max_new: usize, turn: u32) -> TurnMade {
            if turn == 0 && self.meet.as_ref().is_some_and(|m| !m.arrive()) {
                return TurnMade::Skip("alone");
            }
            self.contexts.push(context.to_vec());
            match self.turns[turn as usize] {
                "SKIP" => return TurnMade::Skip("scripted"),
                "STOP" => return TurnMade::Stop,
                _ => {}
            }
            let mut tokens = self.tok.encode(self.turns[turn as usize]).unwrap();
            let finish = if tokens.len() > max_new {
                tokens.truncate(max_new);
                Finish::Length
            } else {
                Finish::Stop
            };
            let n = tokens.len();
            TurnMade::Turn(
                Response {
                    tokens,
                    logprobs: vec![-0.5; n],
                    versions: vec![turn + 3; n],
                    finish: Some(finish),
                },
                7,
            )
        }
    }

    /// Calls `f` with a runner on the built-in calculator, the problem it
    /// is reset with, and the tokenizer.
    fn with_runner<R>(
        limits: Limits,
        f: impl FnOnce(&Runner<'_>, &Problem, &TextTokenizer) -> R,
    ) -> R {
        let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 2).unwrap());
        let problem = task.train_problem(0);
        let env = Calculator::new(task.clone());
        let tok = TextTokenizer::char_level();
        let renderer = Renderer::new(Arc::new(tok.clone()), None, None, 32, TruncateSide::Right);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let info = rt.block_on(env.describe()).unwrap();
        let stop = [tok.token_id("<eos>").unwrap()];
        let runner = Runner {
            env: &env,
            info: &info,
            renderer: &renderer,
            tokenizer: &tok,
            stop_tokens: &stop,
            limits,
            retry: Retry {
                retries: 0,
                backoff: Duration::from_millis(1),
            },
            handle: rt.handle(),
        };
        f(&runner, &problem, &tok)
    }

    /// A script's turns, with `CALL` and `ANSWER` standing for the
    /// problem's tool call and right answer.
    fn script(turns: Vec<&'static str>, problem: &Problem, tok: &TextTokenizer) -> Script {
        let turns = turns
            .into_iter()
            .map(|t| match t {
                "CALL" => Box::leak(
                    format!("<call>{}</call><eos>", problem.prompt.trim_end_matches('='))
                        .into_boxed_str(),
                ) as &str,
                "ANSWER" => Box::leak(format!("{}<eos>", problem.answer).into_boxed_str()),
                t => t,
            })
            .collect();
        Script {
            tok: tok.clone(),
            turns,
            contexts: Vec::new(),
            meet: None,
        }
    }

    fn input(problem: &Problem) -> ResetInput<'_> {
        ResetInput {
            task: "arith-tool",
            problem,
            seed: 0,
        }
    }

    fn run(turns: Vec<&'static str>, limits: Limits) -> (EpisodeEnd, Script, TextTokenizer) {
        with_runner(limits, |runner, problem, tok| {
            let mut script = script(turns, problem, tok);
            let end = runner.run(input(problem), &mut script);
            (end, script, tok.clone())
        })
    }

    fn limits() -> Limits {
        Limits {
            max_turns: 4,
            max_tokens: 128,
            turn_tokens: 32,
            call_timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(60),
        }
    }

    #[test]
    fn a_tool_call_then_an_answer_makes_one_masked_rollout() {
        let (end, script, tok) = run(vec!["CALL", "ANSWER"], limits());
        let EpisodeEnd::Done(ep) = end else {
            panic!("{end:?}")
        };
        assert_eq!((ep.turns, ep.tool_calls, ep.reward), (2, 1, 1.0));
        assert_eq!(ep.finish, Some(Finish::Stop));
        let text = |mask: u8| {
            let ids: Vec<u32> = ep
                .tokens
                .iter()
                .zip(&ep.mask)
                .filter(|(_, m)| **m == mask)
                .map(|(t, _)| *t)
                .collect();
            tok.decode(&ids).unwrap()
        };
        assert!(text(0).starts_with("<result>") && text(0).ends_with("</result>"));
        assert_eq!(ep.observation_tokens, text(0).len());
        assert!(text(1).starts_with("<call>"));
        // Observation tokens: no log-prob, the version and turn before them.
        for (j, &m) in ep.mask.iter().enumerate() {
            if m == 0 {
                assert_eq!(
                    (ep.logprobs[j], ep.versions[j], ep.turn_ids[j]),
                    (0.0, 3, 0)
                );
            }
        }
        assert_eq!(*ep.turn_ids.last().unwrap(), 1);
        assert_eq!(*ep.versions.last().unwrap(), 4, "turn 2 by newer weights");
        // The second turn saw the first turn and the result, unchanged.
        assert_eq!(
            script.contexts[1],
            [
                ep.prompt.clone(),
                ep.tokens[..script.contexts[1].len() - ep.prompt.len()].to_vec()
            ]
            .concat()
        );
    }

    /// The calculator, but every step fails as a timeout would, counted;
    /// its steps retryable or not (as OpenEnv's are not).
    struct Flaky {
        inner: Calculator,
        retryable: bool,
        steps: std::sync::atomic::AtomicU32,
    }

    impl Environment for Flaky {
        fn describe(&self) -> crate::reward::BoxFuture<'_, Result<EnvInfo, EnvError>> {
            self.inner.describe()
        }
        fn reset<'a>(
            &'a self,
            input: ResetInput<'a>,
        ) -> crate::reward::BoxFuture<'a, Result<super::super::Started, EnvError>> {
            self.inner.reset(input)
        }
        fn step<'a>(
            &'a self,
            _id: &'a str,
            _turn: Turn<'a>,
        ) -> crate::reward::BoxFuture<'a, Result<StepOutcome, EnvError>> {
            self.steps
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(async { Err(EnvError::new("timeout", "slow", true)) })
        }
        fn close<'a>(&'a self, id: &'a str) -> crate::reward::BoxFuture<'a, ()> {
            self.inner.close(id)
        }
        fn steps_retryable(&self) -> bool {
            self.retryable
        }
    }

    /// A step that may act on every send is sent once; one that may be
    /// repeated is retried as configured.
    #[test]
    fn a_step_that_is_not_idempotent_is_never_sent_twice() {
        let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 2).unwrap());
        let problem = task.train_problem(0);
        let tok = TextTokenizer::char_level();
        let renderer = Renderer::new(Arc::new(tok.clone()), None, None, 32, TruncateSide::Right);
        let rt = tokio::runtime::Runtime::new().unwrap();
        let stop = [tok.token_id("<eos>").unwrap()];
        for (retryable, calls) in [(false, 1), (true, 3)] {
            let env = Flaky {
                inner: Calculator::new(task.clone()),
                retryable,
                steps: Default::default(),
            };
            let info = rt.block_on(env.describe()).unwrap();
            let runner = Runner {
                env: &env,
                info: &info,
                renderer: &renderer,
                tokenizer: &tok,
                stop_tokens: &stop,
                limits: limits(),
                retry: Retry {
                    retries: 2,
                    backoff: Duration::from_millis(1),
                },
                handle: rt.handle(),
            };
            let mut script = Script {
                tok: tok.clone(),
                turns: vec!["1<eos>"],
                contexts: Vec::new(),
                meet: None,
            };
            let input = ResetInput {
                task: "arith-tool",
                problem: &problem,
                seed: 0,
            };
            let end = runner.run(input, &mut script);
            assert!(matches!(end, EpisodeEnd::Dropped("timeout")), "{end:?}");
            let sent = env.steps.load(std::sync::atomic::Ordering::Relaxed);
            assert_eq!(sent, calls, "retryable {retryable}");
        }
    }

    /// At once, a group's members are all in their first turn together
    /// (each waits for the others there) and come back in member order;
    /// in turn, one runs at a time and the group ends at the first that
    /// does not finish.
    #[test]
    fn a_groups_members_run_at_once_or_in_turn() {
        with_runner(limits(), |runner, problem, tok| {
            let meet = Arc::new(Meeting {
                n: 4,
                arrived: Default::default(),
                all: Default::default(),
            });
            let turns = |m: usize| {
                if m == 2 {
                    vec!["7<eos>"]
                } else {
                    vec!["CALL", "ANSWER"]
                }
            };
            let members = (0..4)
                .map(|m| {
                    let mut s = script(turns(m), problem, tok);
                    s.meet = Some(meet.clone());
                    (input(problem), s)
                })
                .collect();
            let ends = runner.run_group(members, Members::AtOnce);
            let shape: Vec<Option<u32>> = ends
                .iter()
                .map(|e| match e {
                    EpisodeEnd::Done(ep) => Some(ep.turns),
                    other => panic!("a member did not finish: {other:?}"),
                })
                .collect();
            assert_eq!(shape, [Some(2), Some(2), Some(1), Some(2)], "member order");

            let members = [vec!["ANSWER"], vec!["SKIP"], vec!["ANSWER"]]
                .into_iter()
                .map(|t| (input(problem), script(t, problem, tok)))
                .collect();
            let ends = runner.run_group(members, Members::InTurn);
            assert_eq!(
                ends.len(),
                2,
                "in turn, the group ends at the dropped member"
            );
            assert!(matches!(ends[0], EpisodeEnd::Done(_)), "{:?}", ends[0]);
            assert!(
                matches!(ends[1], EpisodeEnd::Dropped("scripted")),
                "{:?}",
                ends[1]
            );
        })
    }

    /// At once, a member that does not finish ends the others at their
    /// next turn: dropped (counted as `group_dropped`) or, when the actor
    /// is stopping, stopped. Without that they would play all their turns.
    #[test]
    fn a_member_that_does_not_finish_ends_its_siblings() {
        let long = Limits {
            max_turns: 1000,
            max_tokens: 1_000_000,
            ..limits()
        };
        with_runner(long, |runner, problem, tok| {
            for (first, siblings) in [("SKIP", "group_dropped"), ("STOP", "stopped")] {
                let meet = Arc::new(Meeting {
                    n: 3,
                    arrived: Default::default(),
                    all: Default::default(),
                });
                let members = (0..3)
                    .map(|m| {
                        let turns = if m == 0 {
                            vec![first]
                        } else {
                            vec!["CALL"; 1000]
                        };
                        let mut s = script(turns, problem, tok);
                        s.meet = Some(meet.clone());
                        (input(problem), s)
                    })
                    .collect();
                let ends = runner.run_group(members, Members::AtOnce);
                let shape: Vec<&str> = ends
                    .iter()
                    .map(|e| match e {
                        EpisodeEnd::Done(_) => "done",
                        EpisodeEnd::Dropped(reason) => reason,
                        EpisodeEnd::Stopped => "stopped",
                    })
                    .collect();
                let first = if first == "SKIP" {
                    "scripted"
                } else {
                    "stopped"
                };
                assert_eq!(shape, [first, siblings, siblings]);
            }
        })
    }

    #[test]
    fn the_turn_limit_ends_an_episode_unrewarded() {
        let l = Limits {
            max_turns: 2,
            ..limits()
        };
        let (end, _, _) = run(vec!["CALL", "CALL", "ANSWER"], l);
        let EpisodeEnd::Done(ep) = end else {
            panic!("{end:?}")
        };
        assert_eq!(
            (ep.turns, ep.reward, ep.finish),
            (2, 0.0, Some(Finish::Length))
        );
        let l = Limits {
            max_tokens: 20,
            ..limits()
        };
        let (end, _, _) = run(vec!["CALL", "ANSWER"], l);
        let EpisodeEnd::Done(ep) = end else {
            panic!("{end:?}")
        };
        assert!(ep.tokens.len() <= 20 && ep.finish == Some(Finish::Length));
    }
}
