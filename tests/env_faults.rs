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
//!   with each turn acted on once;
//! - a reset slower than the actor's timeout (`--slow-resets`): the
//!   episode it opens is closed, so it does not hold the server's room.

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

/// The reference server on `listen` with `args`, and the address it bound;
/// without client authentication (loopback; tests/env_service.rs runs it
/// with client certificates).
async fn env_server(listen: &str, args: &[&str]) -> (Child, String) {
    let mut all = vec!["--allow-unauthenticated"];
    all.extend_from_slice(args);
    common::script_server("env-server.sh", listen, &all).await
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

/// The one problem these episodes play.
fn problem() -> Problem {
    Problem {
        id: "p".into(),
        prompt: "12*34=".into(),
        answer: "408".into(),
        solution: String::new(),
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
        let problem = problem();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_abandoned_by_its_timeout_leaves_no_episode_open() {
    // Room for one episode on the server; its first reset takes 1.5 s
    // (a container booting), the actor gives up after 300 ms.
    let args = [
        "--max-episodes",
        "1",
        "--slow-resets",
        "1",
        "--reset-delay-ms",
        "1500",
    ];
    let (_server, addr) = env_server("127.0.0.1:0", &args).await;
    let cfg = env_config(&addr, 300, 0);
    let (url, tls) = cfg.validate().unwrap().unwrap();
    let env = Remote::new(&cfg, &url, tls).unwrap();
    let problem = problem();
    let input = ResetInput {
        task: "arith-tool",
        problem: &problem,
        seed: 0,
    };
    let slow = tokio::time::timeout(Duration::from_millis(300), env.reset(input)).await;
    assert!(slow.is_err(), "the slow reset answered in time");
    // Once the server has finished that reset, the episode it opened must
    // not hold its one slot (before the fix it did until its TTL, 600 s:
    // every later reset was RESOURCE_EXHAUSTED).
    tokio::time::sleep(Duration::from_millis(2000)).await;
    let mut last = None;
    for _ in 0..20 {
        match env.reset(input).await {
            Ok(s) => {
                env.close(&s.episode_id).await;
                return;
            }
            Err(e) => {
                assert_eq!(e.reason, "capacity", "{e}");
                last = Some(e);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    panic!("the abandoned reset's episode is still open: {last:?}");
}
