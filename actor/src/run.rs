//! An actor: follow the learner's weights, generate groups on
//! `concurrency` threads (each leased from the buffer first, see
//! `lease.rs`), push them to the buffer, until stopped.
//!
//! On shutdown the slots stop taking new prompts; groups in flight get
//! `shutdown_grace_s` to finish and be pushed, then are aborted.
//!
//! A slot that fails (an error or a panic) takes the whole actor down with
//! the error: a process that looks healthy while generating nothing is
//! worse than one the orchestrator can see die and restart with the same
//! flags, and an actor has no state worth keeping.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::Context;
use bapo_policy::{
    Precision, Response, SamplingParams, burn::prelude::*, tokenizer::TextTokenizer,
};
use bapo_proto::{
    tls::{self, ClientTls},
    v1::rollout_sink_client::RolloutSinkClient,
};
use bapo_tasks::{Problem, Task};
use metrics::{counter, gauge, histogram};
use rand::{Rng, SeedableRng, rngs::SmallRng};
use tokio::sync::watch;

use crate::{
    ActorConfig, EngineKind,
    env::{
        self, ResetInput,
        episode::{self, EpisodeEnd, EpisodePacking},
        slot::SlotModel,
    },
    lease::{Admitted, Leasing, Stop},
    metrics as names,
    push::push_group,
    reward::{self, Retry, RewardConfig, Verifier, score_group},
    rollout::{Origin, Packing, completions, pack},
    seed::fnv1a,
    stop::StopFlag,
    subscription::{self, PolicyCell, Versioned},
    vllm,
};

pub struct ActorOptions {
    pub buffer: String,
    pub learner: String,
    pub actor_id: String,
    pub device: Device,
    /// Compute dtype of generation; the weights are held in it.
    pub precision: Precision,
    /// Mutual TLS to the buffer and the learner; `None`: plaintext.
    pub tls: Option<ClientTls>,
    /// Where rewards come from (`[reward]`).
    pub reward: RewardConfig,
    /// The model directory (`[model] hf_dir`) a vLLM server the actor
    /// starts loads first.
    pub model_dir: Option<std::path::PathBuf>,
    /// The chat template the task's prompts are in, and its system
    /// prompt: an environment's messages are rendered with it (`None`:
    /// raw prompts, observations appended as plain text).
    pub chat: Option<(bapo_policy::chat::ChatTemplate, Option<String>)>,
}

/// What makes a slot's responses: bapo's Burn model, following the
/// weights cell token by token, or a vLLM server (the cell then holds the
/// weights it serves).
use crate::generator::{Generated, Generator};

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
    cfg.validate()?;
    let stop_tokens = tokenizer.stop_ids(&cfg.stop)?;
    let verifier = reward::build(&opts.reward, task.clone(), cfg.shaping.format_bonus)?;
    if cfg.env.enabled() && opts.reward.endpoint != RewardConfig::default().endpoint {
        anyhow::bail!(
            "reward.endpoint = {:?} with [actor.env]: an environment rewards its own \
             episodes; leave [reward] out",
            opts.reward.endpoint
        );
    }
    let episodes = episodes(&cfg, &task, &tokenizer, &opts).await?;
    let channel = tls::connector(&opts.buffer, opts.tls.as_ref())
        .with_context(|| format!("buffer address {:?}", opts.buffer))?
        .connect_lazy();
    let client = RolloutSinkClient::new(channel);
    let leasing = cfg.lease.then(|| {
        Leasing::new(
            client.clone(),
            Duration::from_secs_f64(cfg.lease_weight_wait_s),
        )
    });

    let (stop_tx, stop_rx) = watch::channel(false);
    let weights = follow_weights(&cfg, &opts, stop_rx)?;
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        task,
        verifier,
        episodes,
        retry: Retry::from(&opts.reward),
        tokenizer,
        stop_tokens,
        generator: weights.generator,
        client,
        leasing,
        actor_id: opts.actor_id.clone(),
        handle: tokio::runtime::Handle::current(),
        groups: AtomicU64::new(0),
        tokens: AtomicU64::new(0),
    });
    let phases = Arc::new(Shutdown::new());
    let mut slots = spawn_slots(&shared, &phases, &weights.cell);
    let failure = supervise(&mut slots, shutdown, weights.engine, &cfg, &phases).await;
    let _ = stop_tx.send(true);
    if let Some(e) = failure {
        // Stop the other slots too: the process is about to exit non-zero.
        phases.abort();
        while slots.join_next().await.is_some() {}
        weights.follower.abort();
        return Err(e);
    }
    let _ = weights.follower.await;
    Ok(ActorSummary {
        groups: shared.groups.load(Ordering::Relaxed),
        tokens: shared.tokens.load(Ordering::Relaxed),
    })
}

/// Multi-turn episodes instead of single responses, when `[actor.env]`
/// asks for them.
async fn episodes(
    cfg: &ActorConfig,
    task: &Arc<dyn Task>,
    tokenizer: &Arc<TextTokenizer>,
    opts: &ActorOptions,
) -> anyhow::Result<Option<Arc<env::EnvSetup>>> {
    let episodes = env::setup(
        &cfg.env,
        cfg.sampling.max_new_tokens,
        task.clone(),
        tokenizer.clone(),
        opts.chat.clone(),
    )
    .await?
    .map(Arc::new);
    if episodes.is_some() {
        let how = match cfg.members() {
            env::episode::Members::AtOnce => "at once",
            env::episode::Members::InTurn => "in turn",
        };
        tracing::info!("a group's episodes play {how} ([actor.env] parallel_members)");
    }
    Ok(episodes)
}

/// Where the slots' weights come from: the learner's stream, followed in
/// the background, and with vLLM the engine that serves them.
struct Weights {
    follower: tokio::task::JoinHandle<()>,
    generator: Generator,
    /// What the slots generate with: what arrived (Burn), or what the
    /// engine serves (vLLM).
    cell: PolicyCell,
    /// The vLLM engine's background task.
    engine: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

fn follow_weights(
    cfg: &ActorConfig,
    opts: &ActorOptions,
    stop_rx: watch::Receiver<bool>,
) -> anyhow::Result<Weights> {
    let (cell_tx, cell_rx) = watch::channel(None);
    let follower = tokio::spawn(subscription::follow(
        opts.learner.clone(),
        opts.tls.clone(),
        opts.actor_id.clone(),
        subscription::Target {
            device: opts.device.clone(),
            precision: opts.precision,
            form: match cfg.engine {
                EngineKind::Burn => subscription::Form::Model,
                EngineKind::Vllm => subscription::Form::Wire,
            },
        },
        cell_tx,
        stop_rx.clone(),
    ));
    let (generator, cell, engine) = match cfg.engine {
        EngineKind::Burn => (Generator::Burn, cell_rx, None),
        EngineKind::Vllm => {
            let s = vllm::start(
                &cfg.vllm,
                cfg.mode,
                opts.model_dir.clone(),
                cell_rx,
                stop_rx,
            )?;
            (Generator::Vllm(s.engine), s.serving, Some(s.background))
        }
    };
    Ok(Weights {
        follower,
        generator,
        cell,
        engine,
    })
}

/// One generation thread per `concurrency`, each with its own view of the
/// weights cell.
fn spawn_slots(
    shared: &Arc<Shared>,
    phases: &Arc<Shutdown>,
    cell: &PolicyCell,
) -> tokio::task::JoinSet<Result<(), SlotError>> {
    // The nonce keeps group ids unique across restarts; it does not reach
    // the sampling RNG (see `slot_rng`).
    let nonce: u32 = SmallRng::from_os_rng().random();
    let mut slots = tokio::task::JoinSet::new();
    for slot in 0..shared.cfg.concurrency {
        let s = Slot {
            shared: shared.clone(),
            shutdown: phases.clone(),
            cell: cell.clone(),
            abort_rx: phases.aborted(),
            prefix: format!("{}-{nonce:08x}-{slot}", shared.actor_id),
            slot,
        };
        slots.spawn_blocking(move || s.run());
    }
    slots
}

/// Waits for the slots to end, or for `shutdown` (then gives in-flight
/// groups their grace period). The first slot failure, or an engine that
/// can never serve, ends the wait and is returned, logged and counted.
async fn supervise(
    slots: &mut tokio::task::JoinSet<Result<(), SlotError>>,
    shutdown: impl std::future::Future<Output = ()>,
    engine: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    cfg: &ActorConfig,
    phases: &Shutdown,
) -> Option<anyhow::Error> {
    tokio::pin!(shutdown);
    let engine_failed = async {
        match engine {
            Some(task) => match task.await {
                Ok(Ok(())) => std::future::pending().await,
                Ok(Err(e)) => e,
                Err(join) => anyhow::anyhow!("vLLM engine task: {join}"),
            },
            None => std::future::pending().await,
        }
    };
    tokio::pin!(engine_failed);
    let (mut deadline, mut aborted) = (None, false);
    loop {
        let grace = async {
            match deadline {
                Some(d) if !aborted => tokio::time::sleep_until(d).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            next = slots.join_next() => match next {
                None => return None,
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => return Some(slot_failed(anyhow::Error::new(e))),
                Some(Err(join)) => {
                    return Some(slot_failed(anyhow::anyhow!("generation slot panicked: {join}")));
                }
            },
            e = &mut engine_failed => return Some(slot_failed(e)),
            _ = &mut shutdown, if deadline.is_none() => {
                tracing::info!("shutting down: finishing in-flight groups");
                phases.begin();
                let grace = Duration::from_secs_f64(cfg.shutdown_grace_s.max(0.0));
                deadline = Some(tokio::time::Instant::now() + grace);
            }
            _ = grace => {
                tracing::warn!("in-flight groups did not finish within the grace period; aborting them");
                phases.abort();
                aborted = true;
            }
        }
    }
}

fn slot_failed(e: anyhow::Error) -> anyhow::Error {
    counter!(names::SLOT_FAILURES).increment(1);
    tracing::error!("{e:#}; stopping the actor so it can be restarted");
    e
}

/// Why a generation slot stopped working.
#[derive(Debug, thiserror::Error)]
pub enum SlotError {
    #[error("the weight subscription ended before any weights arrived")]
    NoWeights,
}

/// What every generation slot shares: the setup, read-only, and the
/// counters the summary reads.
struct Shared {
    cfg: ActorConfig,
    task: Arc<dyn Task>,
    verifier: Arc<dyn Verifier>,
    /// Multi-turn episodes instead of single responses (`[actor.env]`).
    episodes: Option<Arc<env::EnvSetup>>,
    retry: Retry,
    tokenizer: Arc<TextTokenizer>,
    stop_tokens: Vec<u32>,
    generator: Generator,
    client: RolloutSinkClient<tls::AuthChannel>,
    /// `None` with `lease = false`.
    leasing: Option<Arc<Leasing>>,
    actor_id: String,
    handle: tokio::runtime::Handle,
    groups: AtomicU64,
    tokens: AtomicU64,
}

/// The actor's shutdown, in two phases, kept in step in one place: first
/// no new groups (in-flight ones finish: SIGTERM), then, past the grace
/// period or on a failure, in-flight ones stop at once. Slots poll the
/// flags; whatever blocks (a lease, a wait for weights) awaits them.
struct Shutdown {
    stopping: StopFlag,
    abort: Arc<AtomicBool>,
    abort_tx: watch::Sender<bool>,
}

impl Shutdown {
    fn new() -> Self {
        Self {
            stopping: StopFlag::new(),
            abort: Arc::new(AtomicBool::new(false)),
            abort_tx: watch::channel(false).0,
        }
    }

    /// Phase one: take no new groups.
    fn begin(&self) {
        self.stopping.set();
    }

    /// Phase two: stop what is in flight.
    fn abort(&self) {
        self.stopping.set();
        self.abort.store(true, Ordering::Relaxed);
        let _ = self.abort_tx.send(true);
    }

    /// A receiver that sees [`Shutdown::abort`].
    fn aborted(&self) -> watch::Receiver<bool> {
        self.abort_tx.subscribe()
    }
}

/// One generation thread's state.
struct Slot {
    shared: Arc<Shared>,
    shutdown: Arc<Shutdown>,
    cell: PolicyCell,
    abort_rx: watch::Receiver<bool>,
    prefix: String,
    slot: usize,
}

impl Slot {
    fn run(mut self) -> Result<(), SlotError> {
        if !self.wait_for_weights()? {
            return Ok(());
        }
        let mut rng = slot_rng(
            &self.shared.actor_id,
            self.slot,
            self.shared.cfg.sampling.seed,
            self.shared.cfg.os_entropy,
        );
        let mut n = 0u64;
        let mut params = self.shared.cfg.sampling.clone();
        params.stop_tokens = self.shared.stop_tokens.clone();
        while !self.shutdown.stopping.is_set()
            && (self.shared.cfg.max_groups == 0
                || self.shared.groups.load(Ordering::Relaxed) < self.shared.cfg.max_groups)
        {
            let problem = self.shared.task.train_problem(rng.random());
            let Some(prompt) = self.prompt(&problem) else {
                continue;
            };
            // None only while a vLLM engine is down or reloading.
            let Some(start) = self.cell.borrow_and_update().clone() else {
                if !self.wait_for_weights()? {
                    return Ok(());
                }
                continue;
            };
            if !fits(&problem, &prompt, start.config().max_position_embeddings) {
                continue;
            }
            let group_id = format!("{}-{n}", self.prefix);
            n += 1;
            let lease = match self.admit(&group_id) {
                Admitted::Stopped => return Ok(()),
                a => a,
            };
            // The newest weights: a lease may have waited for them.
            let start = self.cell.borrow_and_update().clone().unwrap_or(start);
            params.seed = rng.random();
            let t0 = Instant::now();
            let made = match self.shared.episodes.clone() {
                Some(setup) => self.episode_group(&setup, &problem, &params, &group_id),
                None => self.single_turn_group(start, &problem, &prompt, &params, &group_id),
            };
            let rollouts = match made {
                GroupMade::Rollouts(r) => r,
                GroupMade::Skip => {
                    // Dropped and counted where it failed; its room goes
                    // back to the buffer now, not at the lease's TTL.
                    if let Admitted::Leased(held) = lease {
                        held.give_back(&self.shared.handle);
                    }
                    continue;
                }
                GroupMade::Stop => return Ok(()),
            };
            histogram!(names::GROUP_SECONDS).record(t0.elapsed().as_secs_f64());
            // The group's first rollout takes the lease's place.
            drop(lease);
            if !self.push(&rollouts) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// One prompt's K responses, scored and packed.
    fn single_turn_group(
        &mut self,
        start: Arc<Versioned>,
        problem: &Problem,
        prompt: &[u32],
        params: &SamplingParams,
        group_id: &str,
    ) -> GroupMade {
        let (responses, incarnation) = match self.generate(start, prompt, params) {
            Made::Group(r, i) => (r, i),
            Made::Skip => return GroupMade::Skip,
            Made::Stop => return GroupMade::Stop,
        };
        let Some(scored) = self.score(problem, &responses) else {
            return GroupMade::Stop;
        };
        let Ok(scores) = scored else {
            // Dropped and counted by `score_group`; the next problem.
            return GroupMade::Skip;
        };
        let origin = Origin {
            group_id,
            actor_id: &self.shared.actor_id,
            incarnation,
        };
        GroupMade::Rollouts(self.pack(params, problem, prompt, responses, scores, &origin))
    }

    /// One problem's K episodes, one after another; a dropped episode
    /// drops the group (its advantages need every member).
    fn episode_group(
        &mut self,
        setup: &env::EnvSetup,
        problem: &Problem,
        params: &SamplingParams,
        group_id: &str,
    ) -> GroupMade {
        let runner = setup.runner(
            &self.shared.tokenizer,
            &self.shared.stop_tokens,
            &self.shared.handle,
        );
        let members = (0..self.shared.cfg.group_size as u64)
            .map(|member| {
                let model = SlotModel {
                    engine: self.shared.generator.clone(),
                    cell: self.cell.clone(),
                    mode: self.shared.cfg.mode,
                    params: params.clone(),
                    member,
                    abort: self.shutdown.abort.clone(),
                    abort_rx: self.abort_rx.clone(),
                    handle: self.shared.handle.clone(),
                };
                let input = ResetInput {
                    task: self.shared.task.name(),
                    problem,
                    seed: fnv1a(&format!("{}-{member}", params.seed)),
                };
                (input, model)
            })
            .collect();
        let mut episodes = Vec::with_capacity(self.shared.cfg.group_size);
        for end in runner.run_group(members, self.shared.cfg.members()) {
            match end {
                EpisodeEnd::Done(ep) => episodes.push(*ep),
                EpisodeEnd::Stopped => return GroupMade::Stop,
                EpisodeEnd::Dropped(_) => {}
            }
        }
        if episodes.len() < self.shared.cfg.group_size {
            // A member was dropped (counted where it failed).
            return GroupMade::Skip;
        }
        // One lineage per group, as for single-turn groups.
        let incarnation = episodes[0].incarnation;
        if episodes.iter().any(|e| e.incarnation != incarnation) {
            counter!(names::EPISODES_DROPPED, "reason" => "new_lineage").increment(1);
            return GroupMade::Skip;
        }
        let source = format!("env:{}", setup.info.name);
        let packing = Packing {
            task: self.shared.task.name(),
            shaping: &self.shared.cfg.shaping,
            sampling: params,
            source: &source,
        };
        let origin = Origin {
            group_id,
            actor_id: &self.shared.actor_id,
            incarnation,
        };
        let p = EpisodePacking {
            packing: &packing,
            task: &*self.shared.task,
            problem,
        };
        let rollouts = episode::pack(&p, episodes, &origin);
        for r in &rollouts {
            histogram!(names::REWARD).record(r.reward as f64);
            histogram!(names::RESPONSE_TOKENS).record((r.response_tokens.len() / 4) as f64);
        }
        GroupMade::Rollouts(rollouts)
    }

    /// The problem's prompt in tokens; `None` (logged) when it is empty or
    /// does not tokenize: the slot moves on to the next problem.
    fn prompt(&self, problem: &Problem) -> Option<Vec<u32>> {
        match self.shared.tokenizer.encode(&problem.prompt) {
            Ok(p) if !p.is_empty() => Some(p),
            Ok(_) => {
                tracing::warn!(problem = %problem.id, "empty prompt; skipped");
                None
            }
            Err(e) => {
                tracing::warn!(problem = %problem.id, "prompt does not tokenize ({e}); skipped");
                None
            }
        }
    }

    /// The scored group as rollouts, with its reward and length metrics.
    fn pack(
        &self,
        params: &SamplingParams,
        problem: &Problem,
        prompt: &[u32],
        responses: Vec<Response>,
        scores: Vec<reward::Scored>,
        origin: &Origin<'_>,
    ) -> Vec<bapo_proto::v1::Rollout> {
        let source = self.shared.verifier.name();
        let packing = Packing {
            task: self.shared.task.name(),
            shaping: &self.shared.cfg.shaping,
            sampling: params,
            source: &source,
        };
        let rollouts = pack(&packing, problem, prompt, responses, scores, origin);
        for r in &rollouts {
            histogram!(names::REWARD).record(r.reward as f64);
            histogram!(names::RESPONSE_TOKENS).record((r.response_tokens.len() / 4) as f64);
        }
        rollouts
    }

    /// Pushes a group and counts it; false when the push was aborted (the
    /// actor is stopping), the only way it ends unacknowledged.
    fn push(&self, rollouts: &[bapo_proto::v1::Rollout]) -> bool {
        let n_tokens: u64 = rollouts
            .iter()
            .map(|r| (r.response_tokens.len() / 4) as u64)
            .sum();
        let mut client = self.shared.client.clone();
        let mut abort = self.abort_rx.clone();
        match self
            .shared
            .handle
            .block_on(push_group(&mut client, rollouts, &mut abort))
        {
            Ok(ack) => {
                counter!(names::GROUPS).increment(1);
                counter!(names::TOKENS).increment(n_tokens);
                self.shared.groups.fetch_add(1, Ordering::Relaxed);
                self.shared.tokens.fetch_add(n_tokens, Ordering::Relaxed);
                if let Some(v) = self.cell.borrow().as_ref() {
                    gauge!(names::VERSIONS_BEHIND)
                        .set(ack.learner_version.saturating_sub(v.version) as f64);
                }
                true
            }
            Err(e) => {
                tracing::warn!("{e}");
                false
            }
        }
    }
}

/// Whether `prompt` leaves room to respond within the model's positions;
/// a problem that does not is skipped, counted and logged.
fn fits(problem: &Problem, prompt: &[u32], max_positions: usize) -> bool {
    if prompt.len() < max_positions {
        return true;
    }
    counter!(names::PROBLEMS_SKIPPED, "reason" => "prompt_too_long").increment(1);
    tracing::warn!(
        problem = %problem.id,
        "prompt of {} tokens leaves no room to respond within the model's \
         max_position_embeddings = {max_positions}; skipped",
        prompt.len()
    );
    false
}

/// What a slot made of one problem.
enum GroupMade {
    Rollouts(Vec<bapo_proto::v1::Rollout>),
    /// Nothing to push (dropped and counted); the next problem.
    Skip,
    /// Aborted: the actor is stopping.
    Stop,
}

/// What a slot's generator made of one problem.
enum Made {
    Group(Vec<Response>, u64),
    /// Nothing usable (the engine went down or refused); the next problem.
    Skip,
    /// Aborted: the actor is stopping.
    Stop,
}

impl Slot {
    /// Waits for weights to generate with (the first ones, or a vLLM
    /// engine back up); `false` when the actor stops meanwhile.
    fn wait_for_weights(&mut self) -> Result<bool, SlotError> {
        let mut cell = self.cell.clone();
        let mut abort = self.abort_rx.clone();
        let got = self.shared.handle.block_on(async {
            tokio::select! {
                r = cell.wait_for(|c| c.is_some()) => r.map(|_| true).map_err(|_| SlotError::NoWeights),
                _ = abort.wait_for(|a| *a) => Ok(false),
            }
        });
        match got {
            Err(_) if self.shutdown.stopping.is_set() => Ok(false),
            got => got,
        }
    }

    /// The group's responses from this slot's generator.
    fn generate(&mut self, start: Arc<Versioned>, prompt: &[u32], params: &SamplingParams) -> Made {
        let slot = crate::generator::Slot {
            cell: &mut self.cell,
            mode: self.shared.cfg.mode,
            abort: &self.shutdown.abort,
            abort_rx: &self.abort_rx,
            handle: &self.shared.handle,
        };
        let k = self.shared.cfg.group_size;
        match self
            .shared
            .generator
            .generate(slot, start, prompt, k, params)
        {
            Generated::Done(responses, incarnation) => Made::Group(responses, incarnation),
            Generated::Stopped => Made::Stop,
            Generated::Failed(e) => {
                self.engine_failed(e);
                Made::Skip
            }
        }
    }

    /// Counts and logs a group the engine could not make; while the
    /// server is down, waits a moment for the loader to notice.
    fn engine_failed(&self, e: vllm::GenerateError) {
        e.settle();
        tracing::warn!("vLLM: {e}; group dropped");
    }
}

impl Slot {
    /// Leases room for `group_id` in the buffer before it is generated
    /// (see `lease.rs`), unless leases are off.
    fn admit(&self, group_id: &str) -> Admitted {
        let Some(leasing) = &self.shared.leasing else {
            return Admitted::Unleased;
        };
        let mut stop = Stop {
            abort: self.abort_rx.clone(),
            stopping: &self.shutdown.stopping,
        };
        self.shared
            .handle
            .block_on(leasing.admit(group_id, &self.cell, &mut stop))
    }

    /// Scores a group's responses (retrying failed calls); `None` when
    /// aborted meanwhile.
    fn score(
        &self,
        problem: &Problem,
        responses: &[Response],
    ) -> Option<Result<Vec<reward::Scored>, reward::RewardError>> {
        let completions = completions(&self.shared.tokenizer, &self.shared.stop_tokens, responses);
        let group = reward::Group {
            task: self.shared.task.name(),
            problem,
            completions: &completions,
        };
        let mut abort = self.abort_rx.clone();
        self.shared.handle.block_on(async {
            tokio::select! {
                r = score_group(&*self.shared.verifier, group, self.shared.retry) => Some(r),
                _ = abort.wait_for(|a| *a) => None,
            }
        })
    }
}

/// The sampling RNG of one slot: it draws the problems and each group's
/// sampling seed. Derived from the actor id, the slot and the configured
/// seed only, so the same seed gives the same rollouts run after run (and
/// slots and actors differ); `os_entropy` asks for fresh OS randomness.
pub fn slot_rng(actor_id: &str, slot: usize, seed: u64, os_entropy: bool) -> SmallRng {
    if os_entropy {
        return SmallRng::from_os_rng();
    }
    SmallRng::seed_from_u64(fnv1a(&format!("{actor_id}-{slot}")) ^ seed)
}
