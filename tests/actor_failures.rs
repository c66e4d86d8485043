//! An actor fails loudly or not at all: a problem the model cannot take is
//! skipped and counted, while a generation slot that dies takes the actor
//! down with an error (a non-zero exit for `bapo actor`), instead of
//! leaving a process that looks healthy and generates nothing.

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use bapo_actor::{ActorConfig, ActorOptions};
use bapo_buffer::BufferConfig;
use bapo_learner::{broadcast::WeightHub, server};
use bapo_policy::{SamplingParams, burn::prelude::*, tokenizer::TextTokenizer};
use bapo_proto::v1::StatsRequest;
use bapo_tasks::{Problem, Task};
use common::TestBuffer;
use tokio::sync::oneshot;

/// Additions whose every other prompt is longer than the tiny model's
/// 512 positions, or that panics after `panic_after` problems.
struct Trap {
    long_every: u64,
    panic_after: Option<u64>,
    drawn: AtomicU64,
}

impl Task for Trap {
    fn name(&self) -> &str {
        "trap"
    }

    fn train_problem(&self, index: u64) -> Problem {
        let n = self.drawn.fetch_add(1, Ordering::Relaxed);
        if self.panic_after.is_some_and(|p| n >= p) {
            panic!("a verifier bug in problem {index}");
        }
        let prompt = if n.is_multiple_of(self.long_every) {
            format!("{}1+1=", " ".repeat(600))
        } else {
            "1+1=".to_string()
        };
        Problem {
            id: format!("p{n}"),
            prompt,
            answer: "2".into(),
            solution: "2".into(),
        }
    }

    fn eval_problems(&self, _: usize) -> Vec<Problem> {
        Vec::new()
    }

    fn score(&self, _: &Problem, completion: &str) -> f32 {
        f32::from(completion.trim() == "2")
    }

    fn reward_range(&self) -> (f32, f32) {
        (0.0, 1.0)
    }
}

/// A learner weight stream serving one tiny policy, and a buffer.
async fn services() -> (TestBuffer, String, oneshot::Sender<()>, WeightHub) {
    let buffer = TestBuffer::start(BufferConfig {
        group_size: 2,
        batch_groups: 1,
        max_staleness: 100,
        ..Default::default()
    })
    .await;
    let hub = WeightHub::new();
    let p = common::tiny(5);
    hub.publish(&p.model, &p.config, 0).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(server::serve(hub.clone(), listener, async {
        let _ = rx.await;
    }));
    (buffer, url, tx, hub)
}

fn run_actor(
    task: Trap,
    buffer: &TestBuffer,
    learner: String,
    max_groups: u64,
) -> tokio::task::JoinHandle<anyhow::Result<bapo_actor::ActorSummary>> {
    let cfg = ActorConfig {
        group_size: 2,
        concurrency: 2,
        sampling: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 4,
            ..Default::default()
        },
        max_groups,
        shutdown_grace_s: 1.0,
        ..Default::default()
    };
    tokio::spawn(bapo_actor::run(
        cfg,
        Arc::new(task),
        Arc::new(TextTokenizer::char_level()),
        ActorOptions {
            buffer: format!("http://{}", buffer.addr),
            learner,
            actor_id: "trap".into(),
            device: Device::flex(),
            precision: Default::default(),
            tls: None,
            reward: Default::default(),
            model_dir: None,
            chat: None,
        },
        std::future::pending(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_prompt_longer_than_the_model_is_skipped_not_a_panic() {
    let (buffer, learner, _stop, _hub) = services().await;
    let task = Trap {
        long_every: 2,
        panic_after: None,
        drawn: AtomicU64::new(0),
    };
    let actor = run_actor(task, &buffer, learner, 4);
    let summary = tokio::time::timeout(Duration::from_secs(120), actor)
        .await
        .expect("the actor finishes its groups")
        .unwrap()
        .expect("over-long prompts are skipped, not fatal");
    assert!(summary.groups >= 4, "{summary:?}");
    let stats = buffer
        .source()
        .await
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stats.rollouts_rejected, 0, "{stats:?}");
    assert!(stats.rollouts_accepted >= 8, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_slot_takes_the_actor_down_with_an_error() {
    let (buffer, learner, _stop, _hub) = services().await;
    let task = Trap {
        long_every: u64::MAX,
        panic_after: Some(3),
        drawn: AtomicU64::new(1),
    };
    let actor = run_actor(task, &buffer, learner, 0);
    let result = tokio::time::timeout(Duration::from_secs(120), actor)
        .await
        .expect("a dead slot ends the actor instead of leaving it idle")
        .unwrap();
    let e = result.expect_err("the actor reports the failure");
    assert!(format!("{e:#}").contains("panicked"), "{e:#}");
}
