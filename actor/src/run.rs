//! An actor: follow the learner's weights, generate groups on
//! `concurrency` threads, push them to the buffer, until stopped.
//!
//! On shutdown the slots stop taking new prompts; groups in flight get
//! `shutdown_grace_s` to finish and be pushed, then are aborted.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_policy::{burn::prelude::*, tokenizer::TextTokenizer};
use bapo_proto::v1::rollout_sink_client::RolloutSinkClient;
use bapo_tasks::Task;
use metrics::{counter, gauge, histogram};
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tokio::sync::watch;
use tonic::transport::Endpoint;

use crate::{
    ActorConfig, metrics as names,
    push::push_group,
    rollout::{Outcome, Scoring, follow_cell, generate, score},
    subscription::{self, PolicyCell},
};

pub struct ActorOptions {
    pub buffer: String,
    pub learner: String,
    pub actor_id: String,
    pub device: Device,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct ActorSummary {
    pub groups: u64,
    pub tokens: u64,
}

pub async fn run(
    cfg: ActorConfig,
    task: Arc<dyn Task>,
    tokenizer: Arc<TextTokenizer>,
    opts: ActorOptions,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<ActorSummary> {
    names::describe();
    anyhow::ensure!(cfg.group_size > 0, "actor.group_size must be at least 1");
    anyhow::ensure!(cfg.concurrency > 0, "actor.concurrency must be at least 1");
    let stop_tokens: Vec<u32> = cfg
        .stop
        .iter()
        .filter_map(|s| tokenizer.token_id(s))
        .collect();
    anyhow::ensure!(
        !stop_tokens.is_empty(),
        "none of the stop tokens {:?} is in the tokenizer",
        cfg.stop
    );
    let channel = Endpoint::from_shared(opts.buffer.clone())
        .with_context(|| format!("buffer address {:?}", opts.buffer))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect_lazy();
    let client = RolloutSinkClient::new(channel);

    let (stop_tx, stop_rx) = watch::channel(false);
    let (abort_tx, abort_rx) = watch::channel(false);
    let (cell_tx, cell_rx) = watch::channel(None);
    let follower = tokio::spawn(subscription::follow(
        opts.learner.clone(),
        opts.actor_id.clone(),
        opts.device.clone(),
        cell_tx,
        stop_rx.clone(),
    ));

    let abort_flag = Arc::new(AtomicBool::new(false));
    let stopping = Arc::new(AtomicBool::new(false));
    let groups_done = Arc::new(AtomicU64::new(0));
    let tokens_done = Arc::new(AtomicU64::new(0));
    let nonce: u32 = SmallRng::from_os_rng().random();
    let handle = tokio::runtime::Handle::current();
    let mut slots = Vec::new();
    for slot in 0..cfg.concurrency {
        let ctx = Slot {
            cfg: cfg.clone(),
            task: task.clone(),
            tokenizer: tokenizer.clone(),
            stop_tokens: stop_tokens.clone(),
            cell: cell_rx.clone(),
            client: client.clone(),
            abort_rx: abort_rx.clone(),
            abort: abort_flag.clone(),
            stopping: stopping.clone(),
            groups: groups_done.clone(),
            tokens: tokens_done.clone(),
            actor_id: opts.actor_id.clone(),
            prefix: format!("{}-{nonce:08x}-{slot}", opts.actor_id),
            handle: handle.clone(),
        };
        slots.push(tokio::task::spawn_blocking(move || ctx.run()));
    }
    let all = futures::future::join_all(slots);
    tokio::pin!(all);
    tokio::pin!(shutdown);
    tokio::select! {
        _ = &mut all => {}
        _ = &mut shutdown => {
            tracing::info!("shutting down: finishing in-flight groups");
            stopping.store(true, Ordering::Relaxed);
            let grace = Duration::from_secs_f64(cfg.shutdown_grace_s.max(0.0));
            if tokio::time::timeout(grace, &mut all).await.is_err() {
                tracing::warn!("in-flight groups did not finish within {grace:?}; aborting them");
                abort_flag.store(true, Ordering::Relaxed);
                let _ = abort_tx.send(true);
                all.await;
            }
        }
    }
    let _ = stop_tx.send(true);
    let _ = follower.await;
    Ok(ActorSummary {
        groups: groups_done.load(Ordering::Relaxed),
        tokens: tokens_done.load(Ordering::Relaxed),
    })
}

/// One generation thread's state.
struct Slot {
    cfg: ActorConfig,
    task: Arc<dyn Task>,
    tokenizer: Arc<TextTokenizer>,
    stop_tokens: Vec<u32>,
    cell: PolicyCell,
    client: RolloutSinkClient<tonic::transport::Channel>,
    abort_rx: watch::Receiver<bool>,
    abort: Arc<AtomicBool>,
    stopping: Arc<AtomicBool>,
    groups: Arc<AtomicU64>,
    tokens: Arc<AtomicU64>,
    actor_id: String,
    prefix: String,
    handle: tokio::runtime::Handle,
}

impl Slot {
    fn run(mut self) {
        // Wait for the first weights (or an abort before they come).
        let mut cell = self.cell.clone();
        let got_weights = self.handle.block_on(async {
            tokio::select! {
                r = cell.wait_for(|c| c.is_some()) => r.is_ok(),
                _ = self.abort_rx.wait_for(|a| *a) => false,
            }
        });
        if !got_weights {
            return;
        }
        let mut rng = SmallRng::seed_from_u64(fxhash(&self.prefix) ^ self.cfg.sampling.seed);
        let mut n = 0u64;
        let mut params = self.cfg.sampling.clone();
        params.stop_tokens = self.stop_tokens.clone();
        while !self.stopping.load(Ordering::Relaxed)
            && (self.cfg.max_groups == 0
                || self.groups.load(Ordering::Relaxed) < self.cfg.max_groups)
        {
            let problem = self.task.train_problem(rng.random());
            let prompt = match self.tokenizer.encode(&problem.prompt) {
                Ok(p) if !p.is_empty() => p,
                Ok(_) => {
                    tracing::warn!(problem = %problem.id, "empty prompt; skipped");
                    continue;
                }
                Err(e) => {
                    tracing::warn!(problem = %problem.id, "prompt does not tokenize ({e}); skipped");
                    continue;
                }
            };
            let group_id = format!("{}-{n}", self.prefix);
            n += 1;
            params.seed = rng.random();
            let t0 = Instant::now();
            let Some(start) = self.cell.borrow_and_update().clone() else {
                return;
            };
            let responses = match generate(
                start,
                &mut follow_cell(&mut self.cell),
                &prompt,
                self.cfg.group_size,
                &params,
                self.cfg.mode,
                &self.abort,
            ) {
                Outcome::Done(r) => r,
                Outcome::Aborted => return,
            };
            let scoring = Scoring {
                task: &self.task,
                tokenizer: &self.tokenizer,
                shaping: &self.cfg.shaping,
                stop_tokens: &self.stop_tokens,
            };
            let rollouts = score(
                &scoring,
                &problem,
                &prompt,
                responses,
                &group_id,
                &self.actor_id,
            );
            histogram!(names::GROUP_SECONDS).record(t0.elapsed().as_secs_f64());
            let n_tokens: u64 = rollouts
                .iter()
                .map(|r| (r.response_tokens.len() / 4) as u64)
                .sum();
            for r in &rollouts {
                histogram!(names::REWARD).record(r.reward as f64);
                histogram!(names::RESPONSE_TOKENS).record((r.response_tokens.len() / 4) as f64);
            }
            let mut client = self.client.clone();
            let mut abort = self.abort_rx.clone();
            match self
                .handle
                .block_on(push_group(&mut client, &rollouts, &mut abort))
            {
                Ok(ack) => {
                    counter!(names::GROUPS).increment(1);
                    counter!(names::TOKENS).increment(n_tokens);
                    self.groups.fetch_add(1, Ordering::Relaxed);
                    self.tokens.fetch_add(n_tokens, Ordering::Relaxed);
                    if let Some(v) = self.cell.borrow().as_ref() {
                        gauge!(names::VERSIONS_BEHIND)
                            .set(ack.learner_version.saturating_sub(v.version) as f64);
                    }
                }
                Err(e) => {
                    tracing::warn!("{e}");
                    return;
                }
            }
        }
    }
}

/// A stable 64-bit hash of a string (seeds per slot).
fn fxhash(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}
