//! A reward service that misbehaves, served for real on loopback: slow
//! (timeouts fire and the call is retried), failing (retried, then the
//! group dropped), answering NaN, out of its declared range or with the
//! wrong number of scores (refused by name, never used), down and back up
//! (the same verifier resumes). No reward is ever made up.

use std::{
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bapo_actor::reward::{
    self, Completion, Group, Retry, RewardConfig, RewardError, Scored, score_group,
};
use bapo_proto::{
    packed,
    v1::{
        DescribeRequest, ItemScore, RewardInfo, ScoreRequest, ScoreResponse,
        reward_service_server::{RewardService, RewardServiceServer},
    },
};
use bapo_tasks::{Problem, Task, TaskSpec};
use tokio::sync::oneshot;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::{Request, Response, Status};

/// What the fake server does with the next Score call.
#[derive(Debug, Clone)]
enum Mode {
    /// Rewards 1.0, sub-score `correct`, one token reward per token.
    Good,
    Slow(Duration),
    Fail(tonic::Code),
    Reward(f32),
    WrongCount,
    ShortTokenRewards,
}

#[derive(Clone)]
struct Fake {
    /// Modes of the coming calls, in order; the last one repeats.
    modes: Arc<Mutex<Vec<Mode>>>,
    calls: Arc<AtomicUsize>,
}

impl Fake {
    fn new(modes: Vec<Mode>) -> Self {
        Self {
            modes: Arc::new(Mutex::new(modes)),
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn next(&self) -> Mode {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut m = self.modes.lock().unwrap();
        if m.len() > 1 {
            m.remove(0)
        } else {
            m[0].clone()
        }
    }
}

fn good(n_tokens: usize) -> ItemScore {
    ItemScore {
        reward: 1.0,
        token_rewards: packed::pack_f32(&vec![0.5; n_tokens]),
        sub_scores: [("correct".to_string(), 1.0)].into(),
    }
}

#[tonic::async_trait]
impl RewardService for Fake {
    async fn score(&self, req: Request<ScoreRequest>) -> Result<Response<ScoreResponse>, Status> {
        let req = req.into_inner();
        let n = req.items.len();
        let tokens = |i: usize| req.items[i].completion_tokens.len() / 4;
        let scores: Vec<ItemScore> = match self.next() {
            Mode::Good => (0..n).map(|i| good(tokens(i))).collect(),
            Mode::Slow(d) => {
                tokio::time::sleep(d).await;
                (0..n).map(|i| good(tokens(i))).collect()
            }
            Mode::Fail(code) => return Err(Status::new(code, "the judge is out to lunch")),
            Mode::Reward(r) => (0..n)
                .map(|_| ItemScore {
                    reward: r,
                    ..Default::default()
                })
                .collect(),
            Mode::WrongCount => vec![good(tokens(0))],
            Mode::ShortTokenRewards => (0..n).map(|_| good(1)).collect(),
        };
        Ok(Response::new(ScoreResponse {
            scores,
            request_id: req.request_id,
        }))
    }

    type ScoreStreamStream = tokio_stream::Empty<Result<ScoreResponse, Status>>;

    async fn score_stream(
        &self,
        _: Request<tonic::Streaming<ScoreRequest>>,
    ) -> Result<Response<Self::ScoreStreamStream>, Status> {
        Err(Status::unimplemented("not used by actors"))
    }

    async fn describe(&self, _: Request<DescribeRequest>) -> Result<Response<RewardInfo>, Status> {
        Ok(Response::new(RewardInfo {
            name: "fake-judge".into(),
            min_reward: 0.0,
            max_reward: 1.0,
        }))
    }
}

/// Serves `fake` on `listener` until the returned sender is dropped.
fn serve(fake: Fake, listener: tokio::net::TcpListener) -> oneshot::Sender<()> {
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RewardServiceServer::new(fake))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                let _ = rx.await;
            }),
    );
    tx
}

async fn start(fake: Fake) -> (String, oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    (format!("grpc://{addr}"), serve(fake, listener))
}

fn verifier(endpoint: &str, timeout_ms: u64) -> Arc<dyn reward::Verifier> {
    let task: Arc<dyn Task> = Arc::from(bapo_tasks::build(&TaskSpec::default()).unwrap());
    let cfg = RewardConfig {
        endpoint: endpoint.into(),
        timeout_ms,
        send_tokens: true,
        ..Default::default()
    };
    reward::build(&cfg, task, 0.0).unwrap()
}

fn problem() -> Problem {
    Problem {
        id: "p-1".into(),
        prompt: "2+3=".into(),
        answer: "5".into(),
        solution: "5".into(),
    }
}

fn completions() -> Vec<Completion> {
    (0..3)
        .map(|i| Completion {
            text: format!("{}", 4 + i),
            tokens: vec![7; 2 + i],
            truncated: false,
        })
        .collect()
}

const FAST: Retry = Retry {
    retries: 2,
    backoff: Duration::from_millis(1),
};

async fn score(v: &dyn reward::Verifier, retry: Retry) -> Result<Vec<Scored>, RewardError> {
    let p = problem();
    let c = completions();
    let group = Group {
        task: "arith",
        problem: &p,
        completions: &c,
    };
    score_group(v, group, retry).await
}

#[tokio::test]
async fn a_good_answer_is_used_as_given() {
    let fake = Fake::new(vec![Mode::Good]);
    let (url, _stop) = start(fake.clone()).await;
    let v = verifier(&url, 2_000);
    let s = score(&*v, FAST).await.unwrap();
    assert_eq!(s.len(), 3);
    assert!(s.iter().all(|x| x.reward == 1.0 && !x.well_formed));
    assert_eq!(s[2].token_rewards, vec![0.5; 4], "one per token sent");
    assert_eq!(s[0].sub_scores["correct"], 1.0);
    assert_eq!(v.name(), "fake-judge", "the declared name");
}

#[tokio::test]
async fn a_slow_server_times_out_and_the_retry_gets_the_answer() {
    let fake = Fake::new(vec![Mode::Slow(Duration::from_secs(5)), Mode::Good]);
    let (url, _stop) = start(fake.clone()).await;
    let v = verifier(&url, 200);
    let t0 = std::time::Instant::now();
    let s = score(&*v, FAST).await.unwrap();
    assert_eq!(s.len(), 3);
    assert_eq!(
        fake.calls.load(Ordering::SeqCst),
        2,
        "one timeout, one retry"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the slow call was not waited out"
    );
}

#[tokio::test]
async fn failing_calls_are_retried_then_the_group_is_dropped() {
    let fake = Fake::new(vec![Mode::Fail(tonic::Code::Internal)]);
    let (url, _stop) = start(fake.clone()).await;
    let e = score(&*verifier(&url, 2_000), FAST).await.unwrap_err();
    assert_eq!(e.reason, "error");
    assert!(e.message.contains("out to lunch"), "{e}");
    assert_eq!(fake.calls.load(Ordering::SeqCst), 3, "1 + 2 retries");

    let slow = Fake::new(vec![Mode::Slow(Duration::from_secs(5))]);
    let (url, _stop) = start(slow).await;
    let e = score(&*verifier(&url, 100), FAST).await.unwrap_err();
    assert_eq!(e.reason, "timeout", "{e}");
}

#[tokio::test]
async fn answers_that_break_the_contract_are_refused_by_name() {
    for (mode, reason, says) in [
        (Mode::Reward(f32::NAN), "not_finite", "reward NaN"),
        (
            Mode::Reward(1.5),
            "out_of_range",
            "outside the range [0, 1]",
        ),
        (Mode::Reward(-0.1), "out_of_range", "-0.1"),
        (Mode::WrongCount, "bad_answer", "1 scores for 3 completions"),
        (
            Mode::ShortTokenRewards,
            "bad_answer",
            "1 token rewards for 2 tokens",
        ),
    ] {
        let fake = Fake::new(vec![mode.clone()]);
        let (url, _stop) = start(fake.clone()).await;
        let e = score(&*verifier(&url, 2_000), FAST).await.unwrap_err();
        assert_eq!(e.reason, reason, "{mode:?}: {e}");
        assert!(e.message.contains(says), "{mode:?}: {e}");
        assert!(e.message.contains("fake-judge"), "names the server: {e}");
        assert_eq!(fake.calls.load(Ordering::SeqCst), 3, "{mode:?}: retried");
    }
}

#[tokio::test]
async fn a_server_that_dies_and_comes_back_is_used_again() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let url = format!("grpc://{addr}");
    let stop = serve(Fake::new(vec![Mode::Good]), listener);
    let v = verifier(&url, 1_000);
    score(&*v, FAST).await.expect("up");

    drop(stop);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let e = score(&*v, FAST).await.unwrap_err();
    assert_eq!(e.reason, "unavailable", "{e}");

    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let _stop = serve(Fake::new(vec![Mode::Good]), listener);
    let s = score(
        &*v,
        Retry {
            retries: 20,
            backoff: Duration::from_millis(50),
        },
    )
    .await
    .expect("the same verifier reconnects");
    assert_eq!(s.len(), 3);
}
