//! The whole loop scored by the Python reference reward server
//! (`examples/reward-server`, started by the project's own script, which
//! makes its venv): buffer, learner and an actor on loopback, every reward
//! from the server. The server is then killed: no group is admitted while
//! it is down (nothing is scored by anyone else), and after it comes back
//! on the same port the loop goes on.

mod common;

use std::time::Duration;

use bapo_actor::{ActorOptions, reward::RewardConfig};
use bapo_proto::v1::{SampleRequest, StatsRequest};
use common::{Loop, actor_config, groups_admitted as admitted, wait_until};
use tokio::process::Child;

/// The reference server on `listen`, and the address it bound.
async fn reward_server(listen: &str) -> (Child, String) {
    common::script_server("reward-server.sh", listen, &["--verifier", "math"]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_loop_runs_on_a_python_reward_server_that_dies_and_comes_back() {
    let (mut python, addr) = reward_server("127.0.0.1:0").await;
    let lp = Loop::with(4, 1, 4).await;
    let buffer = &lp.buffer;
    let learner = lp.spawn_learner(lp.learner_config(1, 1_000_000));
    let (actor, stop_actor) = common::spawn_actor(
        actor_config(4),
        ActorOptions {
            reward: RewardConfig {
                endpoint: format!("grpc://{addr}"),
                timeout_ms: 5_000,
                retries: 2,
                backoff_ms: 100,
                ..Default::default()
            },
            ..lp.actor_options("scored-remotely")
        },
    );

    // The learner trains on groups the server scored.
    let mut source = buffer.source().await;
    wait_until("two learner steps", 180, async || {
        let s = source
            .get_stats(StatsRequest {})
            .await
            .unwrap()
            .into_inner();
        s.learner_version >= 2
    })
    .await;
    let batch = source
        .sample(SampleRequest {
            num_groups: 1,
            timeout_ms: 60_000,
            allow_partial: false,
        })
        .await
        .unwrap()
        .into_inner();
    for r in &batch.groups[0].rollouts {
        assert_eq!(
            r.metadata["reward_source"], "math-final-number",
            "{:?}",
            r.metadata
        );
        let correct = &r.metadata["reward.correct"];
        assert_eq!(r.reward.to_string(), *correct, "the reward is the server's");
    }

    // Killed: nothing is admitted while it is down (a group scored just
    // before may still land in the first second).
    python.kill().await.unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = admitted(buffer).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        admitted(buffer).await,
        before,
        "a group was admitted unscored"
    );
    // The groups it dropped gave their leases back: nothing waits out a TTL.
    let s = source
        .get_stats(StatsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(s.leases_released >= 1, "{s:?}");

    // Back on the same port: the same actor scores and pushes again.
    let (_python, again) = reward_server(&addr).await;
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
    assert!(summary.groups >= 3, "{summary:?}");
    learner.abort();
}
