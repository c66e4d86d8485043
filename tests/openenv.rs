//! The OpenEnv adapter against a real OpenEnv server: the example
//! environment of `examples/openenv-server`, built on `openenv-core` and
//! started by the project's own script (which makes its venv).
//!
//! - an episode over `/ws`: a wrong answer, "try again", the right one,
//!   with the model thinking longer than the server's keepalive allows an
//!   unanswered ping (so the connection task must answer them);
//! - the server's session limit: one more session is refused
//!   (`CAPACITY_REACHED`, retryable) until one closes;
//! - a reset abandoned by its timeout frees this actor's slot and the
//!   server's session;
//! - the loop: buffer, learner and an actor whose every episode is played
//!   on the server.

mod common;

use std::{sync::Arc, time::Duration};

use bapo_actor::env::{
    EnvConfig, EnvKind, Environment, ResetInput, Retry,
    config::OpenEnvConfig,
    episode::{EpisodeEnd, Limits, Model, Runner, TurnMade},
    openenv::OpenEnv,
    render::Renderer,
};
use bapo_policy::{Finish, Response, tokenizer::TextTokenizer};
use bapo_tasks::Problem;
use common::{Loop, actor_config, groups_admitted, wait_until};
use tokio::process::Child;

async fn openenv_server(args: &[&str]) -> (Child, String) {
    let (child, addr) = common::script_server("openenv-server.sh", "127.0.0.1:0", args).await;
    (child, format!("http://{addr}"))
}

/// Answers the question it last read, wrong on turn 0 and right on turn
/// 1, thinking `pause` before each turn.
struct Solver {
    tok: TextTokenizer,
    pause: Duration,
}

/// `a op b` of the last "What is a op b?" in `text`.
fn solve(text: &str) -> i64 {
    let q = text.rsplit("What is ").next().unwrap();
    let q = q.split('?').next().unwrap();
    let parts: Vec<&str> = q.split_whitespace().collect();
    let (a, b): (i64, i64) = (parts[0].parse().unwrap(), parts[2].parse().unwrap());
    match parts[1] {
        "+" => a + b,
        "-" => a - b,
        "*" => a * b,
        op => panic!("operator {op} in {text:?}"),
    }
}

impl Model for Solver {
    fn turn(&mut self, context: &[u32], _max_new: usize, turn: u32) -> TurnMade {
        std::thread::sleep(self.pause);
        let answer = solve(&self.tok.decode(context).unwrap()) + i64::from(turn == 0);
        let mut tokens = self.tok.encode(&format!("It is {answer}")).unwrap();
        tokens.push(self.tok.token_id("<eos>").unwrap());
        let n = tokens.len();
        TurnMade::Turn(
            Response {
                tokens,
                logprobs: vec![-0.5; n],
                versions: vec![1; n],
                finish: Some(Finish::Stop),
            },
            0,
        )
    }
}

fn config(base: &str, sessions: usize) -> EnvConfig {
    EnvConfig {
        kind: EnvKind::Openenv,
        endpoint: base.to_string(),
        max_turns: 3,
        max_episode_tokens: 400,
        max_observation_tokens: 128,
        step_timeout_ms: 10_000,
        retries: 1,
        backoff_ms: 100,
        openenv: OpenEnvConfig {
            max_sessions: sessions,
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn connect(base: &str, sessions: usize) -> OpenEnv {
    let cfg = config(base, sessions);
    let (url, _) = cfg.validate().unwrap().unwrap();
    OpenEnv::connect(&url, &cfg.openenv, Duration::from_secs(10))
        .await
        .unwrap()
}

fn problem() -> Problem {
    Problem {
        id: "p".into(),
        prompt: String::new(),
        answer: String::new(),
        solution: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_episode_runs_over_the_websocket_through_keepalive_pings() {
    // Pings every second, a second to answer: a 2.5 s think would drop an
    // idle reader.
    let (_server, base) = openenv_server(&["--ws-ping-interval", "1"]).await;
    let env = connect(&base, 1).await;
    let info = env.describe().await.unwrap();
    assert!(info.name.starts_with("openenv:"), "{info:?}");
    let end = tokio::task::spawn_blocking(move || {
        let tok = TextTokenizer::char_level();
        let renderer = Renderer::new(Arc::new(tok.clone()), None, None, 128, Default::default());
        let stop = [tok.token_id("<eos>").unwrap()];
        let handle = tokio::runtime::Handle::current();
        let runner = Runner {
            env: &env,
            info: &info,
            renderer: &renderer,
            tokenizer: &tok,
            stop_tokens: &stop,
            limits: Limits {
                max_turns: 3,
                max_tokens: 400,
                turn_tokens: 32,
                call_timeout: Duration::from_secs(10),
                deadline: Duration::from_secs(60),
            },
            retry: Retry {
                retries: 1,
                backoff: Duration::from_millis(100),
            },
            handle: &handle,
        };
        let mut model = Solver {
            tok: tok.clone(),
            pause: Duration::from_millis(2500),
        };
        let p = problem();
        let input = ResetInput {
            task: "arith",
            problem: &p,
            seed: 7,
        };
        runner.run(input, &mut model)
    })
    .await
    .unwrap();
    let EpisodeEnd::Done(ep) = end else {
        panic!("{end:?}")
    };
    assert_eq!((ep.turns, ep.reward), (2, 1.0), "{ep:?}");
    assert_eq!(ep.finish, Some(Finish::Stop));
    assert!(ep.observation_tokens > 0 && ep.mask.contains(&0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_beyond_the_servers_limit_is_refused_until_one_closes() {
    let (_server, base) = openenv_server(&["--max-concurrent-envs", "1"]).await;
    let (a, b) = (connect(&base, 1).await, connect(&base, 1).await);
    let p = problem();
    let input = ResetInput {
        task: "arith",
        problem: &p,
        seed: 1,
    };
    let first = a.reset(input).await.unwrap();
    let refused = b.reset(input).await.unwrap_err();
    assert_eq!(
        (refused.reason, refused.retryable),
        ("capacity", true),
        "{refused}"
    );
    // This actor's own pool is full too, before any connection is made.
    assert_eq!(a.reset(input).await.unwrap_err().reason, "capacity");
    a.close(&first.episode_id).await;
    let mut again = None;
    for _ in 0..50 {
        match b.reset(input).await {
            Ok(s) => {
                again = Some(s);
                break;
            }
            Err(e) => {
                assert_eq!(e.reason, "capacity", "{e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(again.is_some(), "the freed session was never granted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_abandoned_by_its_timeout_frees_its_session() {
    // One session on each side; the server's first reset takes 3 s (a
    // container booting), the actor gives up after 0.5 s.
    let args = [
        "--max-concurrent-envs",
        "1",
        "--slow-resets",
        "1",
        "--reset-delay-ms",
        "3000",
    ];
    let (_server, base) = openenv_server(&args).await;
    let env = connect(&base, 1).await;
    let p = problem();
    let input = ResetInput {
        task: "arith",
        problem: &p,
        seed: 3,
    };
    let slow = tokio::time::timeout(Duration::from_millis(500), env.reset(input)).await;
    assert!(slow.is_err(), "the slow reset answered in time");
    // The actor's slot is free at once; the server's once its reset is
    // over and it sees the socket closed.
    let mut last = None;
    for _ in 0..100 {
        match env.reset(input).await {
            Ok(s) => {
                env.close(&s.episode_id).await;
                return;
            }
            Err(e) => {
                assert!(
                    !e.message.contains("max_sessions"),
                    "the abandoned reset still holds the actor's slot: {e}"
                );
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    panic!("no session after the abandoned one: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_loop_trains_on_openenv_episodes() {
    let (_server, base) = openenv_server(&["--max-concurrent-envs", "2"]).await;
    let lp = Loop::with(4, 1, 64).await;
    let learner = lp.spawn_learner(lp.learner_config(1, 1_000_000));
    let mut cfg = actor_config(4);
    cfg.sampling.max_new_tokens = 8;
    cfg.env = config(&base, 1);
    cfg.env.max_episode_tokens = 300;
    let (actor, stop_actor) = common::spawn_actor(cfg, lp.actor_options("openenv"));
    wait_until("two groups of OpenEnv episodes", 300, async || {
        assert!(!actor.is_finished(), "the actor stopped");
        groups_admitted(&lp.buffer).await >= 2
    })
    .await;
    stop_actor.send(()).unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(60), actor)
        .await
        .expect("the actor stops")
        .unwrap()
        .unwrap();
    assert!(summary.groups >= 2, "{summary:?}");
    learner.abort();
}
