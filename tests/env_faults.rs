//! Faults of an environment server, against the Python reference server
//! (`examples/env-server`) as a real process:
//!
//! - killed mid-run (SIGKILL, episodes in flight): no group is admitted
//!   while it is down (no observation or reward is made up), the actor
//!   stays up, and once it is back on the same port the loop goes on;
//! - too slow: each call times out, is retried, and the episode is
//!   dropped by reason `timeout`;
//! - answers lost after acting (`--fail-every`): the retry repeats the
//!   turn number and gets the stored answer, so the episode completes
//!   with each turn acted on once.

mod common;

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use bapo_actor::env::{
    EnvConfig, EnvKind, Environment, ResetInput, Retry,
    episode::{EpisodeEnd, Limits, Model, Runner, TurnMade},
    remote::Remote,
    render::Renderer,
};
use bapo_policy::{Finish, Response, tokenizer::TextTokenizer};
use bapo_tasks::Problem;
use common::{Loop, actor_config, groups_admitted as admitted, wait_until};
use tokio::process::Child;

/// The reference server on `listen` with `args`, and the address it bound.
async fn env_server(listen: &str, args: &[&str]) -> (Child, String) {
    common::script_server("env-server.sh", listen, args).await
}

fn env_config(addr: &str, timeout_ms: u64, retries: u32) -> EnvConfig {
    EnvConfig {
        kind: EnvKind::Grpc,
        endpoint: format!("grpc://{addr}"),
        max_turns: 3,
        max_episode_tokens: 48,
        max_observation_tokens: 16,
        step_timeout_ms: timeout_ms,
        retries,
        backoff_ms: 50,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_loop_survives_an_environment_server_killed_mid_run() {
    let (mut python, addr) = env_server("127.0.0.1:0", &["--env", "calculator"]).await;
    let lp = Loop::with(4, 1, 64).await;
    let buffer = &lp.buffer;
    let learner = lp.spawn_learner(lp.learner_config(1, 1_000_000));
    let mut cfg = actor_config(4);
    cfg.env = env_config(&addr, 2_000, 2);
    let (actor, stop_actor) = common::spawn_actor(cfg, lp.actor_options("episodes"));
    wait_until("two groups of episodes", 180, async || {
        admitted(buffer).await >= 2
    })
    .await;

    // Killed with episodes in flight: nothing is admitted while it is down.
    python.kill().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = admitted(buffer).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        admitted(buffer).await,
        before,
        "a group was admitted without its environment"
    );
    assert!(
        !actor.is_finished(),
        "the actor must outlive its environment"
    );

    // Back on the same port: the same actor plays episodes again.
    let (_python, again) = env_server(&addr, &["--env", "calculator"]).await;
    assert_eq!(again, addr);
    wait_until("groups after the restart", 180, async || {
        admitted(buffer).await >= before + 2
    })
    .await;
    stop_actor.send(()).unwrap();
    let summary = tokio::time::timeout(Duration::from_secs(60), actor)
        .await
        .expect("the actor stops")
        .unwrap()
        .unwrap();
    assert!(summary.groups >= 4, "{summary:?}");
    learner.abort();
}

/// Calls the calculator on the problem, then answers it, as scripted turns.
struct Script {
    tok: TextTokenizer,
    turns: Vec<String>,
}

impl Model for Script {
    fn turn(&mut self, _context: &[u32], _max_new: usize, turn: u32) -> TurnMade {
        let mut tokens = self.tok.encode(&self.turns[turn as usize]).unwrap();
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

/// One scripted episode of `12*34=` against the server at `addr`.
async fn episode(addr: &str, timeout_ms: u64, retries: u32) -> (EpisodeEnd, Duration) {
    let cfg = env_config(addr, timeout_ms, retries);
    let (url, tls) = cfg.validate().unwrap().unwrap();
    let env = Remote::new(&cfg, &url, tls).unwrap();
    let info = env.describe().await.unwrap();
    tokio::task::spawn_blocking(move || {
        let tok = TextTokenizer::char_level();
        let renderer = Renderer::new(Arc::new(tok.clone()), None, None, 16, Default::default());
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
                max_tokens: 48,
                turn_tokens: 16,
                call_timeout: Duration::from_millis(timeout_ms),
                deadline: Duration::from_secs(60),
            },
            retry: Retry {
                retries,
                backoff: Duration::from_millis(50),
            },
            handle: &handle,
        };
        let problem = Problem {
            id: "p".into(),
            prompt: "12*34=".into(),
            answer: "408".into(),
            solution: String::new(),
        };
        let input = ResetInput {
            task: "arith-tool",
            problem: &problem,
            seed: 0,
        };
        let mut script = Script {
            tok: tok.clone(),
            turns: vec!["<call>12*34</call>".into(), "408".into()],
        };
        let t0 = Instant::now();
        (runner.run(input, &mut script), t0.elapsed())
    })
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_environment_times_out_and_lost_answers_are_retried_once_acted() {
    // Every Step 600 ms late against a 200 ms deadline: one call and one
    // retry, then the episode is dropped, within a few deadlines.
    let (_slow, addr) = env_server("127.0.0.1:0", &["--delay-ms", "600"]).await;
    let (end, took) = episode(&addr, 200, 1).await;
    assert!(matches!(end, EpisodeEnd::Dropped("timeout")), "{end:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");

    // Every second Step acts, then fails UNAVAILABLE: the retry repeats
    // the turn and gets the stored answer; the episode completes, right.
    let (_lossy, addr) = env_server("127.0.0.1:0", &["--fail-every", "2"]).await;
    let (end, _) = episode(&addr, 2_000, 2).await;
    let EpisodeEnd::Done(ep) = end else {
        panic!("{end:?}")
    };
    assert_eq!((ep.turns, ep.tool_calls, ep.reward), (2, 1, 1.0), "{ep:?}");
    assert_eq!(ep.finish, Some(Finish::Stop));
}
