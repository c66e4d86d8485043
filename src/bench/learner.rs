//! `bapo bench learner`: the learner's own optimiser step (`Trainer::step`:
//! the BAPO loss over groups, micro-batched backward, AdamW) at a chosen
//! batch shape, with its tokens/s and the process's peak resident memory.
//! `bapo bench model` times a bare training step; this one is what the
//! learner service runs, so its memory is what a learner pod needs.

use std::time::Instant;

use bapo_learner::{LearnerConfig, TrainGroup, Trainer, rollouts::Sequence};
use bapo_policy::{Policy, burn::prelude::*};
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

pub fn run(a: LearnerBenchArgs) -> anyhow::Result<()> {
    let config = super::model_config(&a.config)?;
    let policy = Policy::init(config.clone(), &Device::flex());
    let cfg = LearnerConfig {
        algo: "bapo".into(),
        batch_groups: a.groups,
        micro_batch_seqs: a.micro_batch_seqs,
        max_response_tokens: a.response,
        ..Default::default()
    };
    let mut trainer = Trainer::new(cfg, policy, 0)?;
    let batch = groups(&a, config.vocab_size as u32);
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
    Ok(())
}
