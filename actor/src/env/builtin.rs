//! The built-in environment: a calculator the model may call, in process,
//! over the task's own problems and verifier (so `bapo run` shows
//! multi-turn training without Python). A turn with `<call>EXPR</call>` is
//! answered `<result>VALUE</result>` as a `tool` message; a turn without
//! one is the final answer, scored by the task (see `bapo_tasks::tool`).

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
};

use bapo_tasks::{
    Problem, Task,
    tool::{tool_call, tool_result},
};

use super::{
    EnvError, EnvInfo, Environment, Message, Observation, ResetInput, Started, StepOutcome, Turn,
};
use crate::reward::BoxFuture;

/// Open episodes at most; a leak (episodes never closed) fails loudly
/// instead of growing without bound.
const MAX_OPEN: usize = 4096;

pub struct Calculator {
    task: Arc<dyn Task>,
    open: Mutex<HashMap<String, Open>>,
    next: AtomicU64,
}

struct Open {
    problem: Problem,
    /// The latest answered turn and its answer, for an idempotent retry.
    last: Option<(u32, StepOutcome)>,
    done: bool,
}

impl Calculator {
    pub fn new(task: Arc<dyn Task>) -> Self {
        Self {
            task,
            open: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }

    fn answer(&self, problem: &Problem, turn: Turn<'_>) -> StepOutcome {
        if let Some(expr) = tool_call(turn.text) {
            return StepOutcome {
                observation: Some(Observation::Messages(vec![Message::new(
                    "tool",
                    tool_result(expr),
                )])),
                info: [("tool_call".to_string(), "1".to_string())].into(),
                ..Default::default()
            };
        }
        StepOutcome {
            reward: self.task.score_response(problem, turn.text, turn.truncated),
            done: true,
            ..Default::default()
        }
    }

    fn step_now(&self, id: &str, turn: Turn<'_>) -> Result<StepOutcome, EnvError> {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let ep = open
            .get_mut(id)
            .ok_or_else(|| EnvError::new("not_found", format!("no open episode {id:?}"), false))?;
        let expected = ep.last.as_ref().map_or(0, |(t, _)| t + 1);
        if let Some((t, out)) = &ep.last
            && *t == turn.index
        {
            return Ok(out.clone());
        }
        if ep.done || turn.index != expected {
            return Err(EnvError::new(
                "refused",
                format!("turn {} of episode {id:?}, expected {expected}", turn.index),
                false,
            ));
        }
        let out = self.answer(&ep.problem, turn);
        ep.done = out.done;
        ep.last = Some((turn.index, out.clone()));
        Ok(out)
    }
}

impl Environment for Calculator {
    fn describe(&self) -> BoxFuture<'_, Result<EnvInfo, EnvError>> {
        let (min_reward, max_reward) = self.task.reward_range();
        let info = EnvInfo {
            name: "calculator".into(),
            max_turns: 0,
            min_reward,
            max_reward,
        };
        Box::pin(async move { Ok(info) })
    }

    fn reset<'a>(&'a self, input: ResetInput<'a>) -> BoxFuture<'a, Result<Started, EnvError>> {
        let result = (|| {
            let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
            if open.len() >= MAX_OPEN {
                return Err(EnvError::new(
                    "capacity",
                    format!("{MAX_OPEN} episodes open: are episodes being closed?"),
                    false,
                ));
            }
            let id = format!("calc-{}", self.next.fetch_add(1, Ordering::Relaxed));
            let open_ep = Open {
                problem: input.problem.clone(),
                last: None,
                done: false,
            };
            open.insert(id.clone(), open_ep);
            Ok(Started {
                episode_id: id,
                // The task's prompt is already in the model's format.
                observation: Observation::Text(input.problem.prompt.clone()),
            })
        })();
        Box::pin(async move { result })
    }

    fn step<'a>(
        &'a self,
        episode_id: &'a str,
        turn: Turn<'a>,
    ) -> BoxFuture<'a, Result<StepOutcome, EnvError>> {
        let result = self.step_now(episode_id, turn);
        Box::pin(async move { result })
    }

    fn close<'a>(&'a self, episode_id: &'a str) -> BoxFuture<'a, ()> {
        self.open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(episode_id);
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use bapo_tasks::ArithTool;

    use super::*;

    fn turn(text: &str, index: u32) -> Turn<'_> {
        Turn {
            text,
            tokens: &[],
            truncated: false,
            index,
        }
    }

    #[tokio::test]
    async fn a_call_is_answered_then_the_final_turn_scored() {
        let task: Arc<dyn Task> = Arc::new(ArithTool::new(0, 2).unwrap());
        let env = Calculator::new(task.clone());
        let problem = task.train_problem(0);
        let input = ResetInput {
            task: "arith-tool",
            problem: &problem,
            seed: 1,
        };
        let s = env.reset(input).await.unwrap();
        assert_eq!(s.observation, Observation::Text(problem.prompt.clone()));
        let expr = problem.prompt.trim_end_matches('=');
        let call = format!("<call>{expr}</call>");
        let out = env.step(&s.episode_id, turn(&call, 0)).await.unwrap();
        let want = format!("<result>{}</result>", problem.answer);
        assert_eq!(
            out.observation,
            Some(Observation::Messages(vec![Message::new("tool", want)]))
        );
        assert!(!out.done && out.info["tool_call"] == "1");
        // A retry of turn 0 gets the same answer; turn 2 is refused.
        assert_eq!(env.step(&s.episode_id, turn(&call, 0)).await.unwrap(), out);
        assert_eq!(
            env.step(&s.episode_id, turn("1", 2))
                .await
                .unwrap_err()
                .reason,
            "refused"
        );
        let last = env
            .step(&s.episode_id, turn(&problem.answer, 1))
            .await
            .unwrap();
        assert!(last.done && last.reward == 1.0);
        env.close(&s.episode_id).await;
        let gone = env.step(&s.episode_id, turn("1", 2)).await.unwrap_err();
        assert_eq!((gone.reason, gone.retryable), ("not_found", false));
    }
}
