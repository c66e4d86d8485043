//! Held-out evaluation of a policy that acts in an environment: one
//! greedy episode per problem (and, for pass@k, k sampled ones), scored
//! by the environment's reward, so a tool task's accuracy counts what the
//! model does with its tool. The learner's periodic evaluation, `bapo
//! eval` and `bapo run`'s report use it whenever `[actor.env]` is on.

use std::sync::Arc;

use bapo_policy::{
    Generation, Policy, SamplingParams,
    evaluate::{EvalResult, PassAtK},
    tokenizer::TextTokenizer,
};
use bapo_tasks::{Problem, Task};

use super::{
    EnvConfig, EnvSetup, ResetInput,
    episode::{EpisodeEnd, Model, TurnMade},
};

/// A policy taking turns in process, one member at a time (greedy at
/// temperature 0); `bapo bench episodes` times it.
pub struct PolicyModel<'a> {
    pub policy: &'a Policy,
    pub params: SamplingParams,
}

impl Model for PolicyModel<'_> {
    fn turn(&mut self, context: &[u32], max_new: usize, turn: u32) -> TurnMade {
        let room = self
            .policy
            .config
            .max_position_embeddings
            .saturating_sub(context.len());
        if room == 0 {
            return TurnMade::Skip("context_too_long");
        }
        let params = SamplingParams {
            max_new_tokens: max_new.min(room),
            seed: self.params.seed.wrapping_add(u64::from(turn)),
            ..self.params.clone()
        };
        let mut g = Generation::new(context.to_vec(), 1, params);
        g.run(self.policy, 0);
        match g.into_responses().pop() {
            Some(r) => TurnMade::Turn(r, 0),
            None => TurnMade::Skip("no_response"),
        }
    }
}

/// Episodes of one environment for evaluation, on a runtime of their own
/// (evaluation runs on a blocking thread; the runtime is built and set up
/// on a thread of its own, so a caller inside another runtime may hold
/// one, and is shut down without blocking when dropped).
pub struct EpisodeEval {
    runtime: Option<tokio::runtime::Runtime>,
    setup: EnvSetup,
    task: Arc<dyn Task>,
    tokenizer: Arc<TextTokenizer>,
    stop: Vec<u32>,
}

impl EpisodeEval {
    /// The environment `cfg` names (None when episodes are off), turns of
    /// at most `max_new_tokens`.
    pub fn new(
        cfg: &EnvConfig,
        max_new_tokens: usize,
        task: Arc<dyn Task>,
        tokenizer: Arc<TextTokenizer>,
        chat: Option<(bapo_policy::chat::ChatTemplate, Option<String>)>,
        stop: Vec<u32>,
    ) -> anyhow::Result<Option<Self>> {
        let (cfg, t, tok) = (cfg.clone(), task.clone(), tokenizer.clone());
        let (runtime, setup) = std::thread::spawn(move || -> anyhow::Result<_> {
            // A worker thread of its own: `Handle::block_on` on a
            // current-thread runtime drives no I/O, so a gRPC or OpenEnv
            // environment's calls would never complete.
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()?;
            let setup = runtime.block_on(super::setup(&cfg, max_new_tokens, t, tok, chat));
            Ok((runtime, setup))
        })
        .join()
        .map_err(|_| anyhow::anyhow!("the evaluation environment's setup panicked"))??;
        let Some(setup) = setup? else {
            runtime.shutdown_background();
            return Ok(None);
        };
        Ok(Some(Self {
            runtime: Some(runtime),
            setup,
            task,
            tokenizer,
            stop,
        }))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime.as_ref().expect("held until drop").handle()
    }

    /// The reward of one episode of `problem` at `params` (a dropped
    /// episode scores the environment's lowest reward).
    fn episode(&self, policy: &Policy, problem: &Problem, params: SamplingParams) -> f32 {
        let runner = self
            .setup
            .runner(&self.tokenizer, &self.stop, self.handle());
        let input = ResetInput {
            task: self.task.name(),
            problem,
            seed: params.seed,
        };
        let mut model = PolicyModel { policy, params };
        match runner.run(input, &mut model) {
            EpisodeEnd::Done(ep) => ep.reward,
            _ => self.setup.info.min_reward,
        }
    }

    /// Greedy accuracy (an episode earning the top reward is right), mean
    /// reward and, with `pass`, pass@k of sampled episodes.
    pub fn evaluate(
        &self,
        policy: &Policy,
        problems: &[Problem],
        pass: Option<PassAtK>,
    ) -> EvalResult {
        let full = self.setup.info.max_reward;
        let params = |temperature: f32, seed: u64| SamplingParams {
            temperature,
            stop_tokens: self.stop.clone(),
            seed,
            ..Default::default()
        };
        let (mut correct, mut reward_sum, mut passed) = (0usize, 0.0f64, 0usize);
        for (i, p) in problems.iter().enumerate() {
            let r = self.episode(policy, p, params(0.0, i as u64));
            reward_sum += f64::from(r);
            correct += usize::from(r >= full);
            if let Some(k) = pass {
                let seed = |j: usize| (i * k.k + j) as u64;
                passed += usize::from(
                    (0..k.k)
                        .any(|j| self.episode(policy, p, params(k.temperature, seed(j))) >= full),
                );
            }
        }
        let n = problems.len().max(1) as f64;
        EvalResult {
            problems: problems.len(),
            greedy_accuracy: correct as f64 / n,
            mean_reward: reward_sum / n,
            pass_at_k: pass.map(|_| passed as f64 / n),
            k: pass.map_or(1, |k| k.k),
            pass_temperature: pass.map(|k| k.temperature),
        }
    }
}

impl Drop for EpisodeEval {
    fn drop(&mut self) {
        if let Some(r) = self.runtime.take() {
            r.shutdown_background();
        }
    }
}

#[cfg(test)]
mod tests {
    use bapo_tasks::ArithTool;

    use super::*;
    use crate::env::EnvKind;

    /// The same evaluation of a policy is deterministic, and one is made
    /// and dropped inside a runtime (as the learner does).
    #[tokio::test]
    async fn greedy_episodes_are_scored_by_the_environment_deterministically() {
        let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 1).unwrap());
        let tok = Arc::new(TextTokenizer::char_level());
        let cfg = EnvConfig {
            kind: EnvKind::Builtin,
            max_episode_tokens: 64,
            max_observation_tokens: 16,
            ..Default::default()
        };
        let stop = vec![tok.token_id("<eos>").unwrap()];
        let eval = EpisodeEval::new(&cfg, 16, task.clone(), tok, None, stop)
            .unwrap()
            .unwrap();
        let policy = bapo_policy::testing::tiny_policy(3);
        let problems = task.eval_problems(4);
        let pass = Some(PassAtK {
            k: 2,
            temperature: 1.0,
        });
        let (eval, a, b) = tokio::task::spawn_blocking(move || {
            let a = eval.evaluate(&policy, &problems, pass);
            let b = eval.evaluate(&policy, &problems, pass);
            (eval, a, b)
        })
        .await
        .unwrap();
        assert_eq!(a, b);
        assert_eq!((a.problems, a.k, a.pass_temperature), (4, 2, Some(1.0)));
        drop(eval);
    }
}
