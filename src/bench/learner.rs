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

use bapo_learner::{
    LearnerConfig, StepReport, TrainGroup, Trainer, broadcast::WeightHub, flops, memory,
    rollouts::Sequence,
};
use bapo_policy::{
    ComputeDevice, ModelConfig, Policy, Precision, burn::prelude::Device, lora::LoraConfig,
    weights::Encoding,
};
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
    /// Only the LoRA phase (no full fine-tuning after it).
    #[arg(long)]
    pub lora_only: bool,
    /// `cpu`, `wgpu` or `cuda` (what the binary was built with).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Compute dtype: `f32`, `f16` or `bf16`; master weights stay f32.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Padded tokens per forward/backward pass (`[learner]
    /// micro_batch_tokens`); 0: by `--micro-batch-seqs` only.
    #[arg(long, default_value_t = 0)]
    pub micro_batch_tokens: usize,
    /// Recompute layers in the backward pass (`[learner] checkpoint_layers`).
    #[arg(long)]
    pub checkpoint_layers: bool,
    /// The device's peak in TFLOP/s for model FLOPs utilisation (an H100
    /// SXM: 989.4 dense f16/bf16, 494.7 TF32); 0: not printed.
    #[arg(long, default_value_t = 0.0)]
    pub peak_tflops: f64,
    /// Also print one JSON line per phase (for scripts/device/).
    #[arg(long)]
    pub json: bool,
    /// The device's memory in GiB: a phase the estimate says cannot fit
    /// is refused, by name and with the numbers, instead of run (what the
    /// learner does at start with `device_memory_gib`).
    #[arg(long)]
    pub device_memory_gib: Option<f64>,
    /// Print, instead of running, the memory estimate of this shape on a
    /// GPU of this many GiB (f16 compute, attention scores kept) at
    /// several sequence lengths, full and LoRA, with and without
    /// `checkpoint_layers`: what fits.
    #[arg(long)]
    pub fit_table: Option<f64>,
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
    if let Some(gib) = a.fit_table {
        fit_table(&a, &config, gib);
        return Ok(());
    }
    let tokens = a.groups as usize * a.group_size * (a.prompt + a.response);
    println!(
        "bapo bench learner: {} ({:.1} M parameters), {} groups x {} x ({} + {}) tokens, micro-batches of {} sequences, {} in {}",
        a.config,
        config.num_params() as f64 / 1e6,
        a.groups,
        a.group_size,
        a.prompt,
        a.response,
        a.micro_batch_seqs,
        a.device,
        a.precision
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
        if a.lora_only {
            return Ok(());
        }
        if let Some(t) = &trainer {
            broadcast_bytes(t)?;
        }
        drop(trainer);
        reset_peak_rss();
        println!("-- reference: full fine-tuning");
    }
    let Some(trainer) = phase(&a, &config, None, tokens)? else {
        return Ok(());
    };
    if a.device != "cpu" {
        // The publish numbers below are host work: measured on the CPU.
        return Ok(());
    }
    broadcast_bytes(&trainer)?;
    publish_numbers(&trainer)
}

/// The asked device, refused by name unless it computes in `precision`.
fn device(a: &LearnerBenchArgs, precision: Precision) -> anyhow::Result<Device> {
    let kind: ComputeDevice = a.device.parse()?;
    let device = kind.device_for(precision)?;
    if let Some(adapter) = kind.adapter() {
        println!("adapter: {adapter}");
    }
    Ok(device)
}

/// The policy at `config`'s shape, random, on `device` in `precision`.
fn policy(config: &ModelConfig, device: &Device, precision: Precision) -> Policy {
    let mut policy = Policy::init(config.clone(), device);
    policy.model = policy.model.with_precision(precision);
    policy
}

/// One untimed and `a.steps` timed learner steps; prints their times,
/// the phase's peak memory beside the estimate, and its FLOPs use. `None`
/// when `--device-memory-gib` refuses the phase by the estimate.
fn phase(
    a: &LearnerBenchArgs,
    config: &ModelConfig,
    lora: Option<LoraConfig>,
    tokens: usize,
) -> anyhow::Result<Option<Trainer>> {
    let precision: Precision = a.precision.parse()?;
    let cfg = LearnerConfig {
        algo: "bapo".into(),
        batch_groups: a.groups,
        micro_batch_seqs: a.micro_batch_seqs,
        micro_batch_tokens: a.micro_batch_tokens,
        checkpoint_layers: a.checkpoint_layers,
        max_response_tokens: a.response,
        lora,
        ..Default::default()
    };
    let device = device(a, precision)?;
    let attention = memory::Attention::on(&device, precision);
    let fits_buffers = bapo_policy::device::max_buffer_bytes(&device).map_or(Ok(()), |max| {
        let bounded = LearnerConfig {
            micro_batch_tokens: a.micro_batch_seqs * (a.prompt + a.response),
            ..cfg.clone()
        };
        memory::check_buffers(config, &bounded, max)
    });
    let estimate = match fits_buffers.and_then(|()| admit(a, config, &cfg, (precision, attention)))
    {
        Ok(e) => e,
        Err(refusal) => {
            println!("refused by the estimate: {refusal}");
            if a.json {
                let line = serde_json::json!({
                    "impl": "bapo", "config": a.config, "mode": mode(&cfg),
                    "dtype": a.precision, "refused": refusal,
                });
                println!("{line}");
            }
            return Ok(None);
        }
    };
    let policy = policy(config, &device, precision);
    let mut trainer = Trainer::new(cfg.clone(), policy, 0)?;
    let batch = groups(a, config.vocab_size as u32);
    let t0 = Instant::now();
    trainer.step(&batch)?;
    println!("untimed first step: {:.1} s", t0.elapsed().as_secs_f64());
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..a.steps {
        let t0 = Instant::now();
        let r = trainer.step(&batch)?;
        let s = t0.elapsed().as_secs_f64();
        println!(
            "step {}: {s:.2} s, {:.0} tok/s (trained response tokens {}), loss {:.4}",
            r.step,
            tokens as f64 / s,
            r.tokens,
            r.loss
        );
        times.push(s);
        last = Some(r);
    }
    report(a, config, &cfg, &estimate, &times, last.as_ref());
    Ok(Some(trainer))
}

fn mode(cfg: &LearnerConfig) -> &'static str {
    if cfg.lora.is_some() { "lora" } else { "full" }
}

/// The estimate of this batch's own passes (its sequences are all
/// `prompt + response` long), or why `--device-memory-gib` refuses it.
fn admit(
    a: &LearnerBenchArgs,
    config: &ModelConfig,
    cfg: &LearnerConfig,
    (precision, attention): (Precision, memory::Attention),
) -> Result<memory::MemoryEstimate, String> {
    let mut shaped = config.clone();
    shaped.max_position_embeddings = a.prompt + a.response;
    let estimate = memory::estimate(&shaped, cfg, precision, attention);
    let Some(gib) = a.device_memory_gib else {
        return Ok(estimate);
    };
    // The batch's own passes bound it: checked as under a budget.
    let bounded = LearnerConfig {
        micro_batch_tokens: estimate.pass_tokens as usize,
        ..cfg.clone()
    };
    memory::check(
        &estimate,
        &bounded,
        memory::bytes(gib),
        &shaped,
        precision,
        attention,
    )?;
    Ok(estimate)
}

/// A phase's speed, memory and FLOPs use, as lines and (`--json`) one
/// JSON line.
fn report(
    a: &LearnerBenchArgs,
    config: &ModelConfig,
    cfg: &LearnerConfig,
    estimate: &memory::MemoryEstimate,
    times: &[f64],
    last: Option<&StepReport>,
) {
    let tokens = a.groups as usize * a.group_size * (a.prompt + a.response);
    let mean = times.iter().sum::<f64>() / times.len().max(1) as f64;
    let peak = peak_memory(a, last);
    let flops = flops::per_token(config, cfg.lora.as_ref(), a.prompt + a.response);
    let mfu = (a.peak_tflops > 0.0).then(|| flops * tokens as f64 / mean / (a.peak_tflops * 1e12));
    println!(
        "estimated step memory: {}; measured peak {}",
        estimate.describe(),
        peak.describe()
    );
    if let Some(m) = mfu {
        println!(
            "model FLOPs: {:.2} GFLOP per token, {:.1}% of {} TFLOP/s",
            flops / 1e9,
            100.0 * m,
            a.peak_tflops
        );
    }
    if !a.json {
        return;
    }
    let line = serde_json::json!({
        "impl": "bapo",
        "config": a.config,
        "mode": mode(cfg),
        "dtype": a.precision,
        "device": a.device,
        "params": config.num_params(),
        "trainable": memory::trainable_params(config, cfg.lora.as_ref()),
        "tokens_per_step": tokens,
        "step_s": times,
        "tokens_per_s": tokens as f64 / mean,
        "peak_mem_gb": peak.in_use_gb,
        "reserved_gb": peak.reserved_gb,
        "estimate_gb": estimate.total() as f64 / 1e9,
        "flops_per_token": flops,
        "mfu": mfu,
        "micro_batch_tokens": a.micro_batch_tokens,
        "checkpoint_layers": a.checkpoint_layers,
        "loss": last.map(|r| r.loss),
    });
    println!("{line}");
}

/// The estimate's verdict at sequence lengths 2k, 8k and 32k, each pass
/// a budget of `max(length, 16k)` tokens: one markdown row per length,
/// mode and checkpointing.
fn fit_table(a: &LearnerBenchArgs, config: &ModelConfig, gib: f64) {
    println!(
        "| {} | sequence | pass tokens | checkpoint_layers | estimate (GiB) | fits {gib} GiB |",
        a.config
    );
    println!("|---|---|---|---|---|---|");
    let capacity = memory::bytes(gib);
    for seq in [2048, 8192, 32768] {
        for lora in [None, Some(LoraConfig::default())] {
            for checkpoint_layers in [false, true] {
                let mut shaped = config.clone();
                shaped.max_position_embeddings = seq;
                let cfg = LearnerConfig {
                    micro_batch_tokens: seq.max(16384),
                    checkpoint_layers,
                    lora: lora.clone(),
                    ..Default::default()
                };
                let (p, at) = (Precision::F16, memory::Attention::Scores);
                let e = memory::estimate(&shaped, &cfg, p, at);
                let fits = memory::check(&e, &cfg, capacity, &shaped, p, at).is_ok();
                println!(
                    "| {} | {seq} | {} | {checkpoint_layers} | {:.1} | {} |",
                    if lora.is_some() { "LoRA r16" } else { "full" },
                    e.pass_tokens,
                    memory::gib(e.total()),
                    if fits { "yes" } else { "no" }
                );
            }
        }
    }
}

/// A phase's peak memory: the device pools' (sampled at each pass's
/// peak) on a GPU, the process's resident set on the CPU; GB (1e9).
struct Peak {
    in_use_gb: Option<f64>,
    reserved_gb: Option<f64>,
}

impl Peak {
    fn describe(&self) -> String {
        match (self.in_use_gb, self.reserved_gb) {
            (Some(u), Some(r)) => format!("{u:.2} GB in use, {r:.2} GB reserved on the device"),
            (Some(u), None) => format!("{u:.2} GB resident (the process)"),
            _ => "unknown".into(),
        }
    }
}

fn peak_memory(a: &LearnerBenchArgs, last: Option<&StepReport>) -> Peak {
    let gb = |key: &str| {
        last.and_then(|r| r.metrics.get(key))
            .map(|gib| gib * (1u64 << 30) as f64 / 1e9)
    };
    match (a.device.as_str(), gb("device_mem_in_use_gib")) {
        ("cpu", _) | (_, None) => Peak {
            in_use_gb: peak_rss_gb(),
            reserved_gb: None,
        },
        (_, in_use) => Peak {
            in_use_gb: in_use,
            reserved_gb: gb("device_mem_reserved_gib"),
        },
    }
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
