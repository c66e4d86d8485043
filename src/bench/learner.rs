//! `bapo bench learner`: the learner's own optimiser step (`Trainer::step`:
//! the BAPO loss over groups, micro-batched backward, AdamW) at a chosen
//! batch shape, with its tokens/s and the process's peak resident memory.
//! `bapo bench model` times a bare training step; this one is what the
//! learner service runs, so its memory is what a learner pod needs.
//!
//! With `--lora-rank R` (the default, 16), the same steps under LoRA
//! first, then full fine-tuning as the reference, in one process: step
//! time, peak memory of each phase (the peak is reset between them) and
//! the bytes one broadcast carries.
//!
//! Then the publish after a step: encoding the weights for the broadcast,
//! beside the copy it no longer makes (the reference), and how long an
//! async runtime stalls when the publish runs on it (the old path) and
//! when it runs on a blocking thread (the learner's path now).

use std::{
    future::Future,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bapo_learner::{LearnerConfig, TrainGroup, Trainer, broadcast::WeightHub, rollouts::Sequence};
use bapo_policy::{ModelConfig, Policy, burn::prelude::*, lora::LoraConfig, weights::Encoding};
use clap::Args;
use rand::{Rng, SeedableRng, rngs::SmallRng};

#[derive(Debug, Args)]
pub struct LearnerBenchArgs {
    /// A preset name or the path of a HF `config.json`.
    #[arg(long, default_value = "small")]
    pub config: String,
    /// Groups per step and responses per group.
    #[arg(long, default_value_t = 8)]
    pub groups: u32,
    #[arg(long, default_value_t = 8)]
    pub group_size: usize,
    /// Prompt and response tokens of every sequence.
    #[arg(long, default_value_t = 16)]
    pub prompt: usize,
    #[arg(long, default_value_t = 256)]
    pub response: usize,
    /// Sequences per forward/backward pass (`[learner] micro_batch_seqs`).
    #[arg(long, default_value_t = 8)]
    pub micro_batch_seqs: usize,
    /// Timed steps, after one untimed.
    #[arg(long, default_value_t = 2)]
    pub steps: usize,
    /// LoRA rank of the first phase (all projections, alpha 2r); 0 runs
    /// full fine-tuning only.
    #[arg(long, default_value_t = 16)]
    pub lora_rank: usize,
}

/// Random tokens, rewards alternating right and wrong, behaviour
/// log-probs near the policy's (a little stale): the shapes of real data.
fn groups(a: &LearnerBenchArgs, vocab: u32) -> Vec<TrainGroup> {
    let mut rng = SmallRng::seed_from_u64(7);
    let mut tokens = |n: usize| (0..n).map(|_| rng.random_range(0..vocab)).collect();
    (0..a.groups)
        .map(|g| TrainGroup {
            group_id: format!("bench-{g}"),
            sequence_number: u64::from(g),
            sequences: (0..a.group_size)
                .map(|i| Sequence {
                    prompt: tokens(a.prompt),
                    response: tokens(a.response),
                    behavior_logprobs: vec![-(vocab as f32).ln(); a.response],
                    versions: vec![0; a.response],
                    reward: (i % 2) as f32,
                    ..Default::default()
                })
                .collect(),
        })
        .collect()
}

/// The process's peak resident set so far (Linux `VmHWM`), in GB.
fn peak_rss_gb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1e6)
}

/// Resets the process's peak resident set to its current one (Linux
/// `clear_refs` 5), so the next phase's peak is its own.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

pub fn run(a: LearnerBenchArgs) -> anyhow::Result<()> {
    let config = super::model_config(&a.config)?;
    let tokens = a.groups as usize * a.group_size * (a.prompt + a.response);
    println!(
        "bapo bench learner: {} ({:.1} M parameters), {} groups x {} x ({} + {}) tokens, micro-batches of {} sequences",
        a.config,
        config.num_params() as f64 / 1e6,
        a.groups,
        a.group_size,
        a.prompt,
        a.response,
        a.micro_batch_seqs
    );
    if a.lora_rank > 0 {
        let lora = LoraConfig {
            rank: a.lora_rank,
            alpha: 2.0 * a.lora_rank as f64,
            ..LoraConfig::default()
        };
        println!(
            "-- LoRA r = {} on every projection, base frozen",
            a.lora_rank
        );
        let trainer = phase(&a, &config, Some(lora), tokens)?;
        broadcast_bytes(&trainer)?;
        drop(trainer);
        reset_peak_rss();
        println!("-- reference: full fine-tuning");
    }
    let trainer = phase(&a, &config, None, tokens)?;
    broadcast_bytes(&trainer)?;
    publish_numbers(&trainer)
}

/// One untimed and `a.steps` timed learner steps; prints their times and
/// the phase's peak memory.
fn phase(
    a: &LearnerBenchArgs,
    config: &ModelConfig,
    lora: Option<LoraConfig>,
    tokens: usize,
) -> anyhow::Result<Trainer> {
    let policy = Policy::init(config.clone(), &Device::flex());
    let cfg = LearnerConfig {
        algo: "bapo".into(),
        batch_groups: a.groups,
        micro_batch_seqs: a.micro_batch_seqs,
        max_response_tokens: a.response,
        lora,
        ..Default::default()
    };
    let mut trainer = Trainer::new(cfg, policy, 0)?;
    let batch = groups(a, config.vocab_size as u32);
    let t0 = Instant::now();
    trainer.step(&batch)?;
    println!("untimed first step: {:.1} s", t0.elapsed().as_secs_f64());
    for _ in 0..a.steps {
        let t0 = Instant::now();
        let r = trainer.step(&batch)?;
        let s = t0.elapsed().as_secs_f64();
        println!(
            "step {}: {s:.1} s, {:.0} tok/s (trained response tokens {}), loss {:.4}",
            r.step,
            tokens as f64 / s,
            r.tokens,
            r.loss
        );
    }
    match peak_rss_gb() {
        Some(gb) => println!("peak resident memory: {gb:.2} GB"),
        None => println!("peak resident memory: unknown (no /proc/self/status)"),
    }
    Ok(trainer)
}

/// The bytes one broadcast carries (f32): adapters under LoRA, the model
/// otherwise.
fn broadcast_bytes(trainer: &Trainer) -> anyhow::Result<()> {
    let policy = trainer.policy();
    let hub = WeightHub::with_incarnation(1);
    let publish = |v| match &policy.model.lora {
        Some(_) => hub.publish_adapters(&policy.model, &policy.config, v, Encoding::F32, 1),
        None => hub.publish_as(&policy.model, &policy.config, v, Encoding::F32),
    };
    if policy.model.lora.is_some() {
        // The base is encoded once per subscriber's life, not per version:
        // outside the timing.
        publish(1)?;
    }
    let t0 = Instant::now();
    let p = publish(2)?;
    println!(
        "one broadcast (f32): {:.2} MB, encoded in {:.2} s",
        p.payload.len() as f64 / 1e6,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Publish cost and the runtime stall it causes, inline and off-thread.
fn publish_numbers(trainer: &Trainer) -> anyhow::Result<()> {
    let policy = Arc::new(trainer.policy());
    let hub = WeightHub::with_incarnation(1);
    let t0 = Instant::now();
    let p = hub.publish_as(&policy.model, &policy.config, 1, Encoding::F32)?;
    let publish_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let copy = bytes::Bytes::copy_from_slice(&p.payload);
    let copy_s = t0.elapsed().as_secs_f64();
    println!(
        "publish (f32 encode, {:.0} MB): {publish_s:.2} s; reference, the copy of the \
         payload it no longer makes: {copy_s:.3} s",
        copy.len() as f64 / 1e6
    );
    drop((copy, p));
    // One runtime thread, as a busy learner runtime worker: a 1 ms ticker
    // measures how late it runs while a publish is in progress.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    let (h, pol) = (hub.clone(), policy.clone());
    let inline = rt.block_on(max_tick_lag(async move {
        let _ = h.publish_as(&pol.model, &pol.config, 2, Encoding::F32);
    }));
    let off = rt.block_on(max_tick_lag(async move {
        let _ = tokio::task::spawn_blocking(move || {
            hub.publish_as(&policy.model, &policy.config, 3, Encoding::F32)
        })
        .await;
    }));
    println!(
        "runtime stalled by a publish: {:.0} ms on the runtime thread (reference, the old \
         path), {:.0} ms with spawn_blocking (now)",
        inline.as_secs_f64() * 1e3,
        off.as_secs_f64() * 1e3
    );
    Ok(())
}

/// The longest a 1 ms ticker on the current runtime was late while
/// `work` ran.
async fn max_tick_lag(work: impl Future<Output = ()>) -> Duration {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let ticker = tokio::spawn(async move {
        let mut worst = Duration::ZERO;
        let mut last = Instant::now();
        while !flag.load(Ordering::Relaxed) {
            tokio::time::sleep(Duration::from_millis(1)).await;
            let now = Instant::now();
            worst = worst.max(now - last);
            last = now;
        }
        worst
    });
    tokio::task::yield_now().await;
    work.await;
    stop.store(true, Ordering::Relaxed);
    ticker.await.unwrap_or_default()
}
